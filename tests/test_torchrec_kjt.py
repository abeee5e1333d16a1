"""``nestpipe.datasets.to_kjt`` builds a real TorchRec ``KeyedJaggedTensor`` whose keys, values and lengths are the
batch's, with the ids mapped into the vocabularies as the trainer maps them (``kjt_check``). TorchRec is not a
dependency of the package: in-process where torchrec imports, else under the TorchRec environment's python
(``make torchrec-env`` builds ``.venv-torchrec``; ``TORCHREC_PYTHON`` names another), skipped where neither is."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_to_kjt_matches_torchrec_in_process():
    pytest.importorskip("torchrec")
    import kjt_check

    assert "agrees" in kjt_check.check()


@pytest.mark.slow
def test_to_kjt_matches_torchrec_in_its_environment():
    python = os.environ.get("TORCHREC_PYTHON") or os.path.join(ROOT, ".venv-torchrec", "bin", "python")
    if not os.path.exists(python):
        pytest.skip(f"no TorchRec environment at {python} (`make torchrec-env` builds one)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    p = subprocess.run([python, "-c", "import kjt_check, sys; sys.exit(kjt_check.main())"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "to_kjt agrees with torchrec" in p.stdout, p.stdout
