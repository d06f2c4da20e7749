"""`make demo` (python -m dev.demo, from the repo root) trains, merges with mpiexec -n 2 and
resumes: the README's first command, run as it is."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_demo_trains_merges_and_resumes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dev.demo", "--out", str(tmp_path / "demo")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed" in r.stdout.lower() and r.stdout.rstrip().endswith("demo: OK"), r.stdout
    assert (tmp_path / "demo" / "merged" / "mpitailor_manifest.json").is_file()
    # step 4: the run's export loads in transformers, every weight of the model there
    import transformers
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "demo" / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_hidden_layers == 4
