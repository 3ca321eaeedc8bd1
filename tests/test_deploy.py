"""What can be checked of the GPU deployment without Docker: prefect.yaml's build and push steps
call real prefect-docker steps with arguments they accept, every deployment's image comes from
the build, and docker/Dockerfile installs this project with the Makefile's own recipe on a CUDA
base that matches the pinned torch. (The recipe itself runs on every fresh CI set-up.)"""

import importlib
import inspect
import re
import tomllib
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).parent.parent
GPU_DEPLOYMENTS = {"qwen2.5-vl-3b", "branch-gpu"}


def deployments() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}


def step_function(step: dict):
    ((path, kwargs),) = step.items()
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name), kwargs


def test_gpu_deployments_build_and_push_the_image_they_run():
    for name, deployment in deployments().items():
        if name not in GPU_DEPLOYMENTS:
            assert "build" not in deployment and "push" not in deployment, (
                name
            )  # `prefect deploy --name demo` builds nothing
            continue
        (build,), (push,) = deployment["build"], deployment["push"]
        build_fn, build_args = step_function(build)
        push_fn, push_args = step_function(push)
        assert build_fn.__name__ == "build_docker_image" and push_fn.__name__ == "push_docker_image"
        inspect.signature(build_fn).bind(**{k: v for k, v in build_args.items() if k not in ("id", "requires")})
        inspect.signature(push_fn).bind(**{k: v for k, v in push_args.items() if k != "requires"})
        assert (ROOT / build_args["dockerfile"]).is_file()
        step_id = build_args["id"]
        assert push_args["image_name"] == f"{{{{ {step_id}.image_name }}}}"
        assert deployment["work_pool"]["job_variables"]["image"] == f"{{{{ {step_id}.image }}}}"
        assert deployment["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/opt/merit"


def test_the_dockerfile_installs_the_project_with_the_makefiles_recipe_on_a_matching_cuda():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^RUN make install VENV=/opt/venv EXTRAS=deploy$", dockerfile, re.M)
    assert "WORKDIR /opt/merit" in dockerfile  # where prefect.yaml's pull step runs the flows
    sources = [line.split()[:-1] for line in re.findall(r"^COPY (.+)$", dockerfile, re.M)]  # COPY SRC... DEST
    copied = {part.rstrip("/").removeprefix("./") for parts in sources for part in parts}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"configs", "prefect.yaml", "Makefile", "pyproject.toml", project["project"]["readme"]} <= copied
    base = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)", dockerfile, re.M)
    pinned = re.search(r"^TORCH_SPEC \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert torch.__version__.split("+")[0] == pinned  # the tests run on the pinned torch
    assert base.group(1) == torch.version.cuda.split(".")[0]  # nvcc builds DeepSpeed's ops against it
