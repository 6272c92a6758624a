"""``tigana.trainer``'s public names load on first use, and ``tigana train``'s launcher never imports torch.

The launcher of ``--nproc N`` only reads the config, checks the inputs, starts the trainer processes and waits
for them; importing torch there cost about 1.5 s of CPU a launch (and ``tigana train --help`` as long)."""

from __future__ import annotations

import subprocess
import sys

import tigana.trainer as trainer


def _imports_torch(code: str) -> bool:
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_every_public_name_resolves_to_its_module() -> None:
    for name in trainer.__all__:
        value = getattr(trainer, name)
        assert value is not None and name in dir(trainer)
        module = getattr(value, "__module__", "")
        assert module.startswith("tigana.trainer."), (name, module)
    try:
        trainer.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")


def test_the_launcher_and_the_cli_do_not_import_torch() -> None:
    assert not _imports_torch("import tigana.tools.train_cmd, tigana.trainer.launch, tigana.trainer.inputs")
    assert not _imports_torch("import contextlib\nfrom tigana.tools import cli\n"
                              "with contextlib.suppress(SystemExit):\n    cli.main(['train', '--help'])")
    # a rank does (the trainer processes import it themselves)
    assert _imports_torch("import tigana.trainer.rank")
    assert _imports_torch("from tigana.trainer import PSEmbeddingBags")
