"""tigana.ps.serving — fresh embeddings and predictions for inference, fed by training.

- ``exportlog``: the serving export log that ``tigana admin export TABLE --follow --out DIR`` writes (a
  full export, then deltas in ``seq`` order, named by ``DIR/manifest.json``) and its readers;
- ``modeldir``: the folder of a published model (``tigana train --publish-dir DIR``: its description and dense
  weights; ``tigana admin export --follow --model DIR``: every table's export log);
- ``server``: ``tigana serve --from DIR`` (one table's lookups) or ``--model DIR`` (every table of a model and
  its predictions), over ``tables`` (the served tables) and ``model`` (a served model's versions);
- ``client``: ``ServingClient``, its client.
"""

from tigana.ps.serving.client import ServingClient
from tigana.ps.serving.model import ModelState, Scorer
from tigana.ps.serving.server import (
    ENV_FIELDS,
    SERVICE_NAME,
    ServeConfig,
    ServingHandle,
    load_serve_config,
    load_serve_config_sources,
    start_serving,
)

__all__ = ["ENV_FIELDS", "SERVICE_NAME", "ModelState", "Scorer", "ServeConfig", "ServingClient", "ServingHandle",
           "load_serve_config", "load_serve_config_sources", "start_serving"]
