"""tigana.ps.serving — fresh embeddings for inference, fed by training.

- ``exportlog``: the serving export log that ``tigana admin export TABLE --follow --out DIR`` writes (a
  full export, then deltas in ``seq`` order, named by ``DIR/manifest.json``) and its readers;
- ``server``: ``tigana serve --from DIR``, a read-only lookup server that follows that log, and
  ``ServingClient``, its client.
"""

from tigana.ps.serving.server import (
    ENV_FIELDS,
    SERVICE_NAME,
    ServeConfig,
    ServingClient,
    ServingHandle,
    load_serve_config,
    load_serve_config_sources,
    start_serving,
)

__all__ = ["ENV_FIELDS", "SERVICE_NAME", "ServeConfig", "ServingClient", "ServingHandle", "load_serve_config",
           "load_serve_config_sources", "start_serving"]
