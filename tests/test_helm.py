"""The Helm chart (helm/kvpool): lint, render with several values files, validate every rendered
object against its schema (core kinds with kubernetes-validate's offline schemas, the RayCluster
with KubeRay's CRD), reject bad values with a clear message, and check what the chart wires
together: the `kvpool up` script against the real CLI parser, NOTES.txt's engine commands against
the connectors' config check, the Grafana dashboard against the metrics kvpool exports.

helm comes from `bash helm/get-helm.sh` (into .venv/bin/helm). Without it these tests fail in CI
and skip elsewhere.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import IN_CI, shared_data

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "kvpool"
VALUES_FILES = sorted(str(p.relative_to(CHART)) for p in (CHART / "ci").glob("*-values.yaml"))
VALUE_SETS = ["default", *VALUES_FILES]  # "default": the chart's values.yaml alone
NAMESPACE = "kv"
KUBE_VERSIONS = ("1.25.0", "1.37.0")  # the chart's kubeVersion floor, and the newest schemas bundled
POLICIES = sorted(["adaptive", "density", "density-admit", "lru", "s3fifo", "tiered", "importance", "request-fifo", "request-lru", "reject",
                   "tiered-memory"])
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(what)
    pytest.skip(what)


@functools.cache
def _helm_path() -> str | None:
    for cand in (REPO / ".venv" / "bin" / "helm", Path(sys.executable).parent / "helm"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("helm")


def helm_bin() -> str:
    path = _helm_path()
    if path is None:
        _missing("helm is not installed: run `bash helm/get-helm.sh` (it puts helm 3.17 in .venv/bin)")
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/kvpool-helm-cache", "HELM_CONFIG_HOME": "/tmp/kvpool-helm-config",
           "HELM_DATA_HOME": "/tmp/kvpool-helm-data", "KUBECONFIG": "/dev/null"}
    r = subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=60, env=env)
    if check and r.returncode:
        pytest.fail(f"helm {' '.join(args)} failed ({r.returncode}):\n{r.stderr}{r.stdout}")
    return r


def _values_args(value_set: str, extra: tuple[str, ...] = ()) -> list[str]:
    args = [] if value_set == "default" else ["-f", str(CHART / value_set)]
    return [*args, *extra]


@functools.cache
def render(value_set: str = "default", extra: tuple[str, ...] = (), chart: str = str(CHART)) -> list[dict]:
    out = helm("template", "rel", chart, "--namespace", NAMESPACE, *_values_args(value_set, extra)).stdout
    return [d for d in yaml.load_all(out, Loader=Loader) if d]


def render_error(*extra: str) -> str:
    r = helm("template", "rel", str(CHART), "--namespace", NAMESPACE, *extra, check=False)
    assert r.returncode != 0, f"helm template accepted {extra}"
    return r.stderr


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def values_of(value_set: str) -> dict:
    vals = yaml.safe_load((CHART / "values.yaml").read_text())
    if value_set != "default":
        _merge(vals, yaml.safe_load((CHART / value_set).read_text()))
    return vals


def fullname(value_set: str) -> str:
    return values_of(value_set)["fullnameOverride"] or "rel-kvpool"


def _merge(base: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def ray_pod_specs(rc: dict) -> dict[str, dict]:
    specs = {"head": rc["spec"]["headGroupSpec"]["template"]}
    for g in rc["spec"]["workerGroupSpecs"]:
        specs[g["groupName"]] = g["template"]
    return specs


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ----------------------------------------------------------------------------- lint and schemas


def test_helm_is_helm_3():
    out = helm("version", "--short").stdout
    assert out.startswith("v3."), out


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(value_set):
    r = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *_values_args(value_set))
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout
    # NOTE: helm lint reports a template's `fail` as [INFO] and passes; rendering is the real check.
    assert "[INFO] Fail" not in r.stdout + r.stderr


@pytest.fixture(scope="module")
def kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        _missing("kubernetes-validate is not installed: pip install kubernetes-validate (the dev extras)")
    return kubernetes_validate


CORE_KINDS = {"ConfigMap", "Secret", "Service", "StatefulSet", "Job", "CronJob", "Deployment"}
POOL_SECRET_DIR = "/var/run/secrets/kvpool"
CUSTOM_KINDS = {"RayCluster", "PodMonitor", "ServiceMonitor"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_core_objects_validate_strictly(value_set, kubernetes_validate):
    docs = render(value_set)
    kinds = {d["kind"] for d in docs}
    unknown = kinds - CORE_KINDS - CUSTOM_KINDS
    assert not unknown, f"a kind this test does not validate: {unknown}"
    checked = 0
    for d in docs:
        if d["kind"] in CUSTOM_KINDS:
            continue  # kubernetes-validate has no schema for custom resources: checked below
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{d['kind']}/{d['metadata']['name']} is invalid for Kubernetes {version}: {e.message}"
                            f" at {list(e.path)}")
        checked += 1
    assert checked >= 5


def test_validator_is_strict(kubernetes_validate):
    """The validation above can fail: a misspelt field and a wrong type are both caught."""
    job = json.loads(json.dumps(one(render(), "Job")))
    job["spec"]["backofLimit"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="backofLimit"):
        kubernetes_validate.validate(job, KUBE_VERSIONS[0], strict=True)
    svc = json.loads(json.dumps(one(render(), "Service", "-head")))
    svc["spec"]["ports"][0]["port"] = "6379"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(svc, KUBE_VERSIONS[0], strict=True)


@functools.cache
def _raycluster_schema() -> dict:
    crd = yaml.load(open(shared_data("kuberay", "ray.io_rayclusters.yaml")), Loader=Loader)
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert "v1" in served, f"the CRD serves {sorted(served)}, not v1"
    schema = served["v1"]["schema"]["openAPIV3Schema"]
    _no_unknown_fields(schema)
    return schema


def _no_unknown_fields(node) -> None:
    """The API server drops fields a structural schema does not declare (silently); fail on them
    instead, the way kubernetes-validate's strict mode does for core kinds."""
    if isinstance(node, dict):
        if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for v in node.values():
            _no_unknown_fields(v)
    elif isinstance(node, list):
        for v in node:
            _no_unknown_fields(v)


def crd_errors(rc: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(_raycluster_schema())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(rc)]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_raycluster_matches_kuberay_crd(value_set):
    rc = one(render(value_set), "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert crd_errors(rc) == []
    for group in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]:
        params = group["rayStartParams"]
        assert params and all(isinstance(v, str) for v in params.values()), params


def test_crd_validation_can_fail():
    rc = json.loads(json.dumps(one(render(), "RayCluster")))
    rc["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    rc["spec"]["authOptions"]["mode"] = "tokens"
    errors = crd_errors(rc)
    assert any("rayStartParams.num-gpus: 1 is not of type 'string'" in e for e in errors), errors
    assert any("'volumeMount' was unexpected" in e for e in errors), errors
    assert any("authOptions.mode: 'tokens' is not one of ['disabled', 'token']" in e for e in errors), errors


# ----------------------------------------------------------------------------- what the chart wires


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_raycluster_has_gpu_workers_with_shm_and_metrics(value_set):
    vals = values_of(value_set)
    docs = render(value_set)
    rc = one(docs, "RayCluster")
    assert rc["spec"]["rayVersion"] == vals["ray"]["version"]
    assert rc["spec"]["enableInTreeAutoscaling"] is vals["autoscaling"]["enabled"]
    (wg,) = rc["spec"]["workerGroupSpecs"]
    w = vals["worker"]
    assert (wg["groupName"], wg["replicas"], wg["minReplicas"], wg["maxReplicas"]) == \
        (w["groupName"], w["replicas"], w["minReplicas"], w["maxReplicas"])
    assert wg["rayStartParams"]["num-gpus"] == str(w["gpus"])
    assert wg["rayStartParams"]["object-store-memory"] == str(w["objectStoreMiB"] << 20)
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    image = f"{vals['image']['repository']}:{vals['image']['tag'] or '0.1.0'}"
    slab = vals["pool"]["pageMiB"] * vals["pool"]["dramPages"]
    in_shm = 0 if vals["node"]["enabled"] else slab  # with the run dir on, the slab is there, not in /dev/shm
    for role, tpl in ray_pod_specs(rc).items():
        spec = tpl["spec"]
        (c,) = spec["containers"]
        assert c["image"] == image
        group = vals["head"] if role == "head" else w
        params = rc["spec"]["headGroupSpec"]["rayStartParams"] if role == "head" else wg["rayStartParams"]
        # Ray's metrics export port is the container port named `metrics`.
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == int(params["metrics-export-port"]) == vals["ray"]["metricsPort"]
        vols = {v["name"]: v for v in spec["volumes"]}
        shm = vols["shm"]["emptyDir"]
        assert shm["medium"] == "Memory"
        assert shm["sizeLimit"] == f"{group['objectStoreMiB'] + in_shm + vals['shm']['headroomMiB']}Mi"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"] == "shm" and mounts["/etc/kvpool"] == "config"
        assert mounts[POOL_SECRET_DIR] == "pool-secret"
        if vals["pool"]["disk"]["enabled"]:
            assert mounts[vals["pool"]["disk"]["path"]] == "disk"
            hp = vals["pool"]["disk"]["hostPath"]
            disk_mib = vals["pool"]["pageMiB"] * vals["pool"]["disk"]["pages"]
            if hp:
                assert vols["disk"]["hostPath"]["path"] == hp
            else:
                assert vols["disk"]["emptyDir"]["sizeLimit"] == f"{disk_mib}Mi"
        else:
            assert "disk" not in vols
        env = {e["name"]: e for e in c["env"]}
        assert "KVPOOL_REDIS_URL" in env
        _check_run_dir(vals, value_set, spec, c)
        if role != "head":
            assert c["resources"]["limits"][w["gpuResource"]] == str(w["gpus"])
        else:
            assert not any("gpu" in k for k in c["resources"].get("limits", {}))


def _check_run_dir(vals: dict, value_set: str, spec: dict, c: dict) -> None:
    """A Ray pod (the head runs a shard too): the node run dir as a hostPath on the node's tmpfs at
    node.runDir with $KVPOOL_RUN_DIR, the pod's fixed user, the init container that gives the node
    directories to that user; none of it with node.enabled false."""
    node = vals["node"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    env = {e["name"]: e for e in c["env"]}
    sc = vals["ray"]["podSecurityContext"]
    assert spec["securityContext"] == sc and sc["runAsUser"] == 1000 and sc["runAsGroup"] == 100  # Ray's `ray`
    disk_host = vals["pool"]["disk"]["enabled"] and vals["pool"]["disk"]["hostPath"]
    if not node["enabled"]:
        assert "run-dir" not in vols and "run-dir" not in mounts.values() and "KVPOOL_RUN_DIR" not in env
        assert not any("hostPath" in v for v in vols.values() if v["name"] != "disk")
        if not disk_host:
            assert "initContainers" not in spec
        return
    host = node["hostPath"] or f"/dev/shm/kvpool-{NAMESPACE}-{fullname(value_set)}"
    assert vols["run-dir"]["hostPath"] == {"path": host, "type": "DirectoryOrCreate"}
    assert host.startswith("/dev/shm/")  # the host's tmpfs: the slab is memory
    assert mounts[node["runDir"]] == "run-dir"
    assert env["KVPOOL_RUN_DIR"] == {"name": "KVPOOL_RUN_DIR", "value": node["runDir"]}
    (init,) = spec["initContainers"]
    dirs = [node["runDir"], *([vals["pool"]["disk"]["path"]] if disk_host else [])]
    assert init["command"] == ["/bin/sh", "-c", f"chown 1000:100 {' '.join(dirs)} && chmod 0700 {' '.join(dirs)}"]
    assert init["securityContext"]["runAsUser"] == 0
    assert {m["mountPath"] for m in init["volumeMounts"]} == set(dirs)


def test_run_dir_off_and_moved():
    """node.enabled=false renders no run dir (the slab back in /dev/shm); node.prepare=false no init
    container; a hostPath and runDir of one's own are used as given."""
    on, off = (one(render("default", extra), "RayCluster") for extra in ((), ("--set", "node.enabled=false")))
    for rc in (on, off):
        assert crd_errors(rc) == []
    vals = values_of("default")
    slab = vals["pool"]["pageMiB"] * vals["pool"]["dramPages"]
    for role in ("head", "gpu"):
        specs = [ray_pod_specs(rc)[role]["spec"] for rc in (on, off)]
        sizes = [int({v["name"]: v for v in sp["volumes"]}["shm"]["emptyDir"]["sizeLimit"][:-2]) for sp in specs]
        assert sizes[1] - sizes[0] == slab
        c = specs[1]["containers"][0]
        assert "KVPOOL_RUN_DIR" not in {e["name"] for e in c["env"]}
        assert "run-dir" not in {v["name"] for v in specs[1]["volumes"]} | {m["name"] for m in c["volumeMounts"]}
        assert "initContainers" not in specs[1] and "initContainers" in specs[0]
    rc = one(render("default", ("--set", "node.prepare=false,node.runDir=/run/kv,node.hostPath=/dev/shm/mine")),
             "RayCluster")
    for role, tpl in ray_pod_specs(rc).items():
        spec = tpl["spec"]
        assert "initContainers" not in spec, role
        assert {v["name"]: v for v in spec["volumes"]}["run-dir"]["hostPath"]["path"] == "/dev/shm/mine"
        c = spec["containers"][0]
        assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/run/kv"] == "run-dir"
        assert {e["name"]: e.get("value") for e in c["env"]}["KVPOOL_RUN_DIR"] == "/run/kv"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_services_select_what_they_name(value_set):
    docs = render(value_set)
    rc = one(docs, "RayCluster")
    pods = ray_pod_specs(rc)
    head = pods["head"]
    head_ports = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    for suffix in ("-head", "-dashboard"):
        svc = one(docs, "Service", suffix)
        assert labels_match(svc["spec"]["selector"], head["metadata"]["labels"])
        assert not any(labels_match(svc["spec"]["selector"], t["metadata"]["labels"])
                       for r, t in pods.items() if r != "head"), "a head Service also selects workers"
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= head_ports
    assert {p["name"] for p in one(docs, "Service", "-head")["spec"]["ports"]} == \
        {"gcs-server", "client", "dashboard", "metrics"}
    vals = values_of(value_set)
    assert one(docs, "Service", "-dashboard")["spec"]["type"] == vals["dashboard"]["service"]["type"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_redis_internal_or_external(value_set):
    vals = values_of(value_set)
    docs = render(value_set)
    ray_env = {e["name"]: e for e in ray_pod_specs(one(docs, "RayCluster"))["head"]["spec"]["containers"][0]["env"]}
    if vals["redis"]["mode"] == "external":
        assert not [d for d in docs if d["kind"] == "StatefulSet" or "-redis" in d["metadata"]["name"]]
        ref = ray_env["KVPOOL_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        ext = vals["redis"]["external"]
        assert ref == {"name": ext["existingSecret"], "key": ext["shardSecretKey"] or ext["existingSecretKey"]}
        return
    sts = one(docs, "StatefulSet", "-redis")
    svc = one(docs, "Service", "-redis")
    key = vals["redis"]["auth"]["existingSecretKey"]
    if vals["redis"]["auth"]["existingSecret"]:  # yours: the chart makes none
        assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-redis")]
        secret = {"metadata": {"name": vals["redis"]["auth"]["existingSecret"]}, "data": {}}
    else:
        secret = one(docs, "Secret", "-redis")
    pod = sts["spec"]["template"]
    assert labels_match(svc["spec"]["selector"], pod["metadata"]["labels"])
    assert labels_match(sts["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (c,) = pod["spec"]["containers"]
    assert c["image"] == f"{vals['redis']['image']['repository']}:{vals['redis']['image']['tag']}"
    env = {e["name"]: e for e in c["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": key}
    acl = vals["redis"]["acl"]["enabled"]
    if acl:  # the users' file: rules from kvpool.index.redis_acl, the hashes filled in at start
        assert "users.sh /etc/redis-users/users.acl.in /tmp/users.acl" in c["args"][0]
        assert "aclfile /tmp/users.acl" in c["args"][0] and "requirepass" not in c["args"][0]
        for role in ("OPERATOR", "SHARD", "ENGINE"):
            assert env[f"REDIS_{role}_PASSWORD"]["valueFrom"]["secretKeyRef"] == \
                {"name": secret["metadata"]["name"], "key": f"{role.lower()}-password"}
        users = one(docs, "Secret", "-redis-users")
        assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/etc/redis-users"] == "users"
        assert {v["name"]: v for v in pod["spec"]["volumes"]}["users"]["secret"]["secretName"] == \
            users["metadata"]["name"]
        assert set(users["data"]) == {"users.acl.in", "users.sh"}
    else:
        assert "requirepass" in c["args"][0] and "$REDIS_PASSWORD" in c["args"][0]
        assert not [d for d in docs if d["metadata"]["name"].endswith("-redis-users")]
    if not vals["redis"]["auth"]["existingSecret"]:
        assert set(secret["data"]) == {key, *(["operator-password", "shard-password", "engine-password"] if acl else [])}
    # No password appears in a manifest outside its Secret.
    for value in secret["data"].values():
        plain = base64.b64decode(value).decode()
        assert len(plain) == 32 and all(plain not in json.dumps(d) for d in docs if d is not secret)
    url = ray_env["KVPOOL_REDIS_URL"]["value"]
    user, pw = ("kvpool-shard", "REDIS_SHARD_PASSWORD")  # the Ray pods are the pool's shards
    assert url == f"redis://{user if acl else ''}:$({pw})@{fullname(value_set)}-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    assert ray_env[pw]["valueFrom"]["secretKeyRef"]["key"] == ("shard-password" if acl else key)
    names = [e["name"] for e in ray_pod_specs(one(docs, "RayCluster"))["head"]["spec"]["containers"][0]["env"]]
    assert names.index(pw) < names.index("KVPOOL_REDIS_URL")  # $(VAR) expands only earlier vars
    if vals["redis"]["persistence"]["enabled"]:
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["spec"]["resources"]["requests"]["storage"] == vals["redis"]["persistence"]["size"]
        assert claim["spec"]["storageClassName"] == vals["redis"]["persistence"]["storageClass"]
        assert "--appendonly yes" in c["args"][0]
        assert "data" not in {v["name"] for v in pod["spec"]["volumes"]}
    else:
        assert "volumeClaimTemplates" not in sts["spec"]
        assert "--appendonly no" in c["args"][0]


def test_external_redis_url_and_existing_password_secret():
    docs = render("default", ("--set", "redis.mode=external", "--set", "redis.external.url=redis://idx.example:6380/2"))
    env = {e["name"]: e for e in one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPOOL_REDIS_URL"] == {"name": "KVPOOL_REDIS_URL", "value": "redis://idx.example:6380/2"}
    assert "REDIS_PASSWORD" not in env
    docs = render("default", ("--set", "redis.auth.existingSecret=my-redis,redis.auth.existingSecretKey=pw"))
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret" and "-redis" in d["metadata"]["name"]] == \
        ["rel-kvpool-redis-users"]  # the rules only: the passwords are in my-redis
    (c,) = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "pw"}
    assert {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]} == \
        {"pw", "operator-password", "shard-password", "engine-password"}


def _config(docs: list[dict]) -> dict:
    return one(docs, "ConfigMap", "-config")["data"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pool_config(value_set):
    vals = values_of(value_set)
    cfg = json.loads(_config(render(value_set))["pool.json"])
    p = vals["pool"]
    assert cfg["chunk_tokens"] == p["chunkTokens"]
    policy = "lru" if p["policy"] == "tiered-memory" else p["policy"]  # LRU per tier, demoting to disk
    store = {"page_bytes": p["pageMiB"] << 20, "dram_pages": p["dramPages"], "policy": policy}
    if p["disk"]["enabled"]:
        store |= {"disk_dir": p["disk"]["path"], "disk_pages": p["disk"]["pages"]}
    assert cfg["store"] == store
    assert [t["id"] for t in cfg["tenants"]] == [t["id"] for t in p["tenants"]]
    assert [t.get("quota") for t in cfg["tenants"]] == [t.get("quota") or None for t in p["tenants"]]
    assert cfg["ray"]["namespace"] == "kvpool" and cfg["ray"]["address"].startswith("ray://")
    token = vals["ray"]["auth"]["mode"] == "token"
    name = fullname(value_set)
    assert cfg["ray"]["auth_mode"] == vals["ray"]["auth"]["mode"]
    assert cfg["ray"].get("token_secret") == (f"{vals['ray']['auth']['existingSecret'] or name + '-ray-token'}"
                                              "/auth_token" if token else None)
    a = vals["auth"]
    assert cfg["auth"] == {"secret_file": f"{POOL_SECRET_DIR}/{a['existingSecretKey']}",
                           "secret": f"{a['existingSecret'] or name + '-pool-secret'}/{a['existingSecretKey']}"}
    r = vals["redis"]
    if r["mode"] == "internal":  # where the password is, never the password
        secret = r["auth"]["existingSecret"] or f"{name}-redis"
        want = {"backend": "redis", "url": f"redis://{name}-redis.{NAMESPACE}.svc.cluster.local:6379/0",
                "password_secret": f"{secret}/{r['auth']['existingSecretKey']}"}
        if r["acl"]["enabled"]:
            want["users"] = {role: {"user": f"kvpool-{role}", "password_secret": f"{secret}/{role}-password"}
                             for role in ("operator", "shard", "engine")}
        assert cfg["index"] == want
    else:
        ext = r["external"]
        want = {"backend": "redis", "url_secret": f"{ext['existingSecret']}/{ext['existingSecretKey']}"}
        for role in ("shard", "engine"):
            if ext[f"{role}SecretKey"]:
                want[f"{role}_url_secret"] = f"{ext['existingSecret']}/{ext[f'{role}SecretKey']}"
        assert cfg["index"] == want
    # The store part is StoreConfig's own vocabulary: it builds one.
    from kvpool.store import StoreConfig

    StoreConfig(**{k: v for k, v in cfg["store"].items()})


def _run_scripts(data: dict, tmp_path: Path, scripts: list[str]) -> list[list[str]]:
    """Runs the rendered scripts with stub `kvpool` and `python` commands that record their argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    stub = f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
    for name in ("kvpool", "python"):
        (bin_dir / name).write_text(stub)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "KVPOOL_RAY_ADDRESS": "ray://head:10001",
           "KVPOOL_REDIS_URL": "redis://op:pw@redis:6379/0", "KVPOOL_POOL_REDIS_URL": "redis://shard:pw@redis:6379/0"}
    for s in scripts:
        path = tmp_path / s
        path.write_text(data[s])
        r = subprocess.run(["sh", str(path)], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [[Path(c[0]).name, *c[1:]] for c in calls]


def test_tiers_sized_in_mib_become_whole_pages():
    """pool.dramMiB and pool.disk.sizeMiB instead of page counts: as many whole pages as fit, in
    the shards' config, `kvpool up`'s arguments, the memory checks and the disk volume."""
    docs = render("default", ("--set", "pool.pageMiB=48,pool.dramMiB=1000,pool.disk.enabled=true,"
                              "pool.disk.sizeMiB=10000,pool.disk.hostPath="))
    cfg = json.loads(_config(docs)["pool.json"])
    assert cfg["store"]["page_bytes"] == 48 << 20
    assert cfg["store"]["dram_pages"] == 20 and cfg["store"]["disk_pages"] == 208  # 1000 // 48, 10000 // 48
    up = " ".join(str(v) for v in _config(docs).values())
    assert "--dram-pages 20" in up and "--disk-pages 208" in up
    text = yaml.safe_dump_all(docs)
    assert "sizeLimit: 9984Mi" in text  # the disk emptyDir: 208 pages of 48 MiB
    # without the MiB values, the page counts as before
    cfg = json.loads(_config(render("default", ("--set", "pool.pageMiB=48")))["pool.json"])
    assert cfg["store"]["dram_pages"] == values_of("default")["pool"]["dramPages"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_up_script_runs_the_real_cli(value_set, tmp_path):
    """The Job's script calls `kvpool up` (and tenants, warmup) with flags the CLI really has."""
    from kvpool.cli import build_parser

    vals = values_of(value_set)
    docs = render(value_set)
    data = _config(docs)
    job = one(docs, "Job")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    warm = vals["warmup"]["enabled"]
    assert command == ["/bin/sh", "-c", "sh /etc/kvpool/up.sh" + (" && sh /etc/kvpool/warmup.sh" if warm else "")]
    assert ("warmup.sh" in data) is warm and ("warmup.jsonl" in data) is warm
    calls = _run_scripts(data, tmp_path, ["up.sh", *(["warmup.sh"] if warm else [])])
    assert calls[0] == ["python", "/etc/kvpool/wait_for_ray.py"]
    parser = build_parser()
    parsed = [parser.parse_args(c[1:]) for c in calls[1:]]
    assert all(c[0] == "kvpool" for c in calls[1:])
    up = parsed[0]
    p = vals["pool"]
    # the pool's actors get the shard's index URL; the quotas below take the operator's
    assert (up.command, up.ray_address, up.redis) == ("up", "ray://head:10001", "redis://shard:pw@redis:6379/0")
    assert up.secret_file is None  # the Job's $KVPOOL_SECRET_FILE, mounted
    assert all(a.redis == "redis://op:pw@redis:6379/0" for a in parsed[1:] if a.command == "tenants")
    policy = "lru" if p["policy"] == "tiered-memory" else p["policy"]
    assert (up.page_size, up.dram_pages, up.policy) == (f"{p['pageMiB']}MiB", p["dramPages"], policy)
    assert up.tenant == [t["id"] for t in p["tenants"]]
    if p["disk"]["enabled"]:
        assert (up.disk_dir, up.disk_pages) == (p["disk"]["path"], p["disk"]["pages"])
    else:
        assert up.disk_dir is None
    tenant_calls = [(a.action, a.args) for a in parsed[1:] if a.command == "tenants"]
    want = []
    for t in p["tenants"]:
        if t.get("quota"):
            want.append(("set-quota", [t["id"], t["quota"]]))
        want.append(("set-priority", [t["id"], t.get("priority", "normal")]))
    assert tenant_calls == want
    warmups = [a for a in parsed if a.command == "warmup"]
    if warm:
        (w,) = warmups
        assert (w.file, w.model, w.chunk_tokens, w.no_pin) == \
            ("/etc/kvpool/warmup.jsonl", vals["warmup"]["model"], p["chunkTokens"], not vals["warmup"]["pin"])
        assert w.model_id == (vals["warmup"]["modelId"] or None)
        from kvpool.connectors.warmup import load_entries

        (tmp_path / "warmup.jsonl").write_text(data["warmup.jsonl"])
        entries = load_entries(str(tmp_path / "warmup.jsonl"))
        assert [(e["tenant"], e["tokens"], e["shared"]) for e in entries] == \
            [(e["tenant"], e["tokens"], e.get("shared", False)) for e in vals["warmup"]["entries"]]
    else:
        assert warmups == []


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_up_job_waits_for_every_node_and_reconciles(value_set):
    vals = values_of(value_set)
    docs = render(value_set)
    job = one(docs, "Job")
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPOOL_WAIT_NODES"] == str(vals["up"]["waitForNodes"] or 1 + vals["worker"]["replicas"])
    assert env["KVPOOL_RAY_ADDRESS"] == f"ray://{one(docs, 'Service', '-head')['metadata']['name']}." \
        f"{NAMESPACE}.svc.{vals['clusterDomain']}:{vals['ray']['clientPort']}"
    annotations = job["metadata"].get("annotations", {})
    if vals["up"]["hook"]:
        assert annotations["helm.sh/hook"] == "post-install,post-upgrade"
        assert job["metadata"]["name"].endswith("-up")
    else:
        assert "helm.sh/hook" not in annotations
        assert job["metadata"]["name"].endswith("-up-r1")  # one per revision
    crons = [d for d in docs if d["kind"] == "CronJob"]
    assert len(crons) == int(vals["up"]["reconcile"]["enabled"])
    for cron in crons:
        c = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["/bin/sh", "-c", "sh /etc/kvpool/up.sh"]  # never the warm-up again
        assert {e["name"]: e.get("value") for e in c["env"]}["KVPOOL_WAIT_NODES"] == "1"


def _load_wait_for_ray():
    spec = importlib.util.spec_from_file_location("wait_for_ray", CHART / "files" / "wait_for_ray.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeRay:
    """The part of `ray` wait_for_ray uses: the head refuses `fail_inits` connections, then the
    cluster grows by one node per poll up to `nodes`."""

    def __init__(self, fail_inits: int, nodes: int):
        self.fail_inits, self.total, self.seen, self.up, self.inits = fail_inits, nodes, 0, False, []

    def is_initialized(self):
        return self.up

    def init(self, address, **kw):
        self.inits.append((address, kw.get("namespace")))
        if self.fail_inits:
            self.fail_inits -= 1
            raise ConnectionError("head not ready")
        self.up = True

    def shutdown(self):
        self.up = False

    def nodes(self):
        self.seen = min(self.seen + 1, self.total)
        return [{"Alive": True}] * self.seen + [{"Alive": False}]


def test_wait_for_ray_waits_then_gives_up_with_the_reason():
    mod = _load_wait_for_ray()
    ray = FakeRay(fail_inits=2, nodes=5)
    log = []
    assert mod.wait(ray, "ray://h:10001", 3, timeout_s=5, poll_s=0, log=log.append) == 3
    assert ray.inits == [("ray://h:10001", "kvpool")] * 3
    assert log[-1] == "wait_for_ray: 3 of 3 Ray nodes alive"
    with pytest.raises(TimeoutError, match=r"2 of 9 Ray nodes alive"):
        mod.wait(FakeRay(0, 2), "ray://h:10001", 9, timeout_s=0.05, poll_s=0.01, log=lambda _: None)
    with pytest.raises(TimeoutError, match=r"did not answer \(ConnectionError: head not ready\)"):
        mod.wait(FakeRay(10**6, 1), "ray://h:10001", 1, timeout_s=0.05, poll_s=0.01, log=lambda _: None)
    # The copy in the ConfigMap is this file.
    assert _config(render())["wait_for_ray.py"].strip() == (CHART / "files" / "wait_for_ray.py").read_text().strip()


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_prometheus_scrapes_every_ray_pod(value_set):
    vals = values_of(value_set)
    docs = render(value_set)
    monitors = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"
                and not d["metadata"]["name"].endswith("-router")]  # the router's: test_the_router_...
    if not vals["monitoring"]["enabled"]:
        assert monitors == []
        return
    (mon,) = monitors
    assert mon["kind"] == vals["monitoring"]["kind"]
    assert labels_match(vals["monitoring"]["labels"], mon["metadata"]["labels"])
    pods = ray_pod_specs(one(docs, "RayCluster"))
    if mon["kind"] == "PodMonitor":
        sel = mon["spec"]["selector"]
        (expr,) = sel["matchExpressions"]
        selected = [r for r, t in pods.items() if labels_match(sel["matchLabels"], t["metadata"]["labels"])
                    and t["metadata"]["labels"][expr["key"]] in expr["values"]]
        (ep,) = mon["spec"]["podMetricsEndpoints"]
    else:
        svc = one(docs, "Service", "-metrics")
        assert svc["spec"]["clusterIP"] == "None"
        assert labels_match(mon["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        selected = [r for r, t in pods.items() if labels_match(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert not labels_match(svc["spec"]["selector"], one(docs, "StatefulSet")["spec"]["template"]["metadata"]
                                ["labels"]) if vals["redis"]["mode"] == "internal" else True
        (ep,) = mon["spec"]["endpoints"]
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert sorted(selected) == sorted(pods)
    assert ep["port"] == "metrics" and ep["interval"] == vals["monitoring"]["interval"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "ray_io_cluster"} \
        in ep["relabelings"]
    assert mon["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


# ----------------------------------------------------------------------------- defence in depth


def pool_pod_specs(docs: list[dict]) -> dict[str, dict]:
    """The pod spec of every kvpool container that talks to Ray: the Ray pods, the Job, the CronJob."""
    out = {role: tpl["spec"] for role, tpl in ray_pod_specs(one(docs, "RayCluster")).items()}
    out["job"] = one(docs, "Job")["spec"]["template"]["spec"]
    for cron in (d for d in docs if d["kind"] == "CronJob"):
        out["cronjob"] = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return out


def _generated(docs: list[dict], suffix: str) -> list[dict]:
    return [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith(suffix)]


def _secret_value(docs: list[dict], secret: dict, key: str, length: int) -> str:
    """A generated Secret's value: ``length`` random characters that no other manifest holds."""
    value = base64.b64decode(secret["data"][key]).decode()
    assert len(value) == length
    assert all(value not in json.dumps(d) for d in docs if d is not secret)
    return value


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_ray_token_auth_is_on_unless_disabled(value_set):
    vals = values_of(value_set)
    docs = render(value_set)
    rc = one(docs, "RayCluster")
    auth = vals["ray"]["auth"]
    token = auth["mode"] == "token"
    name = auth["existingSecret"] or f"{fullname(value_set)}-ray-token"
    generated = _generated(docs, "-ray-token")
    if token:
        assert rc["spec"]["authOptions"] == {"mode": "token", "secretName": name}  # KubeRay's own wiring
        if auth["existingSecret"]:
            assert generated == []
        else:
            (secret,) = generated
            assert secret["metadata"]["name"] == name
            _secret_value(docs, secret, "auth_token", 64)
    else:
        assert "authOptions" not in rc["spec"] and generated == []
    for where, spec in pool_pod_specs(docs).items():
        (c,) = spec["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == auth["mode"], where  # explicit: Ray's default changes by version
        if token:  # also without KubeRay's authOptions (an older operator drops the field)
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": name, "key": "auth_token"}, where
        else:
            assert "RAY_AUTH_TOKEN" not in env, where
    assert crd_errors(rc) == []


def test_ray_token_from_an_existing_secret():
    docs = render("default", ("--set", "ray.auth.existingSecret=my-ray-token"))
    assert _generated(docs, "-ray-token") == []
    assert one(docs, "RayCluster")["spec"]["authOptions"]["secretName"] == "my-ray-token"
    (c,) = one(docs, "Job")["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e for e in c["env"]}["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-ray-token"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pool_secret_is_mounted_into_every_pool_pod(value_set, tmp_path):
    from kvpool.auth import Authority

    vals = values_of(value_set)
    docs = render(value_set)
    a = vals["auth"]
    name, key = a["existingSecret"] or f"{fullname(value_set)}-pool-secret", a["existingSecretKey"]
    generated = _generated(docs, "-pool-secret")
    if a["existingSecret"]:
        assert generated == []
    else:
        (secret,) = generated
        mounted = tmp_path / key  # the file the pods see
        mounted.write_text(_secret_value(docs, secret, key, 64))
        mounted.chmod(0o400)  # as the kubelet mounts it (defaultMode): kvpool refuses a file others can read
        assert Authority.from_env({"KVPOOL_SECRET_FILE": str(mounted)}).secured
    for where, spec in pool_pod_specs(docs).items():
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["pool-secret"]["secret"] == {"secretName": name, "defaultMode": 0o400,
                                                 "items": [{"key": key, "path": key}]}, where
        sc = spec.get("securityContext") or {}
        assert sc.get("runAsUser", 0) == 0 or "fsGroup" in sc, where  # a non-root pod reads it through fsGroup
        (c,) = spec["containers"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["pool-secret"] == {"name": "pool-secret", "mountPath": POOL_SECRET_DIR, "readOnly": True}
        env = {e["name"]: e for e in c["env"]}
        assert env["KVPOOL_SECRET_FILE"] == {"name": "KVPOOL_SECRET_FILE", "value": f"{POOL_SECRET_DIR}/{key}"}
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):  # Redis has no business with it
        assert "pool-secret" not in json.dumps(sts)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_each_component_reaches_the_index_as_its_own_redis_user(value_set):
    vals = values_of(value_set)
    docs = render(value_set)
    r = vals["redis"]
    if r["mode"] == "external":
        want = {"shard": r["external"]["shardSecretKey"] or r["external"]["existingSecretKey"],
                "operator": r["external"]["existingSecretKey"]}
        key = lambda env, var: env[var]["valueFrom"]["secretKeyRef"]["key"]  # noqa: E731
    else:
        acl = r["acl"]["enabled"]
        want = {role: f"kvpool-{role}" if acl else "" for role in ("shard", "operator")}
        key = lambda env, var: env[var]["value"].split("//")[1].split(":")[0]  # noqa: E731 - the URL's user
    for where, spec in pool_pod_specs(docs).items():
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        if where in ("job", "cronjob"):  # the operator; the actors it starts get the shard's URL
            assert (key(env, "KVPOOL_REDIS_URL"), key(env, "KVPOOL_POOL_REDIS_URL")) == \
                (want["operator"], want["shard"]), where
        else:
            assert key(env, "KVPOOL_REDIS_URL") == want["shard"] and "KVPOOL_POOL_REDIS_URL" not in env, where


# ----------------------------------------------------------------------------- bad values


BAD_VALUES = [
    (("--set", "worker.replicas=two"), "worker.replicas: Invalid type. Expected: integer, given: string"),
    (("--set", "worker.gpus=null"), "worker: gpus is required"),
    (("--set", "worker.gpus=0"), "worker.gpus: Must be greater than or equal to 1"),
    (("--set", "pool.policy=fifo"), "pool.policy: pool.policy must be one of the following: " +
     ", ".join(f'"{p}"' for p in POLICIES)),
    (("--set", "pool.pageMiB=32MB"), "pool.pageMiB: Invalid type. Expected: integer, given: string"),
    (("--set", "pool.dramPages=0"), "pool.dramPages: Must be greater than or equal to 1"),
    (("--set", "pool.dramMiB=0"), "pool.dramMiB: Must be greater than or equal to 1"),
    (("--set", "pool.dramMiB=16"), "pool.dramMiB 16 holds no page of pool.pageMiB 32 MiB: raise pool.dramMiB to 32"),
    (("--set", "pool.disk.enabled=true,pool.disk.sizeMiB=8"), "pool.disk.sizeMiB 8 holds no page of pool.pageMiB 32"),
    (("--set", "head.resources.limits.memory=lots"), "head.resources.limits.memory: Does not match pattern"),
    (("--set", "redis.persistence.size=big"), "redis.persistence.size: Does not match pattern"),
    (("--set", "pool.tenants[0].id=a b,pool.tenants[0].quota=10 gigs"), "pool.tenants.0.quota: Does not match pattern"),
    (("--set", "worker.rayStartParams.num-cpus=4"),
     "worker.rayStartParams.num-cpus: Invalid type. Expected: string, given: integer"),
    (("--set", "worker.gpu=2"), "worker: Additional property gpu is not allowed"),
    (("--set", "redis.mode=sentinel"), 'redis.mode: redis.mode must be one of the following: "internal", "external"'),
    (("--set", "monitoring.kind=Probe"), "monitoring.kind: monitoring.kind must be one of the following"),
    (("--set", "warmup.enabled=true"), "warmup.model: String length must be greater than or equal to 1"),
    (("--set-json", 'warmup.entries=[{"tenant":"default","tokens":[-1]}]'),
     "warmup.entries.0.tokens.0: Must be greater than or equal to 0"),
    # Checks across values, at render time:
    (("--set", "pool.policy=tiered-memory"), "pool.policy=tiered-memory demotes DRAM -> disk before dropping: "
     "set pool.disk.enabled=true"),
    (("--set", "worker.minReplicas=3"), "worker: need minReplicas <= replicas <= maxReplicas, got 3 <= 2 <= 2"),
    (("--set-string", "head.resources.limits.memory=2Gi"),
     "head.resources.limits.memory 2Gi does not exceed its shared memory of 3584 MiB"),
    # the slab counts against the limit in the run dir too (the shard's pod is charged for it)
    (("--set-string", "head.resources.limits.memory=3584Mi"), "/dev/shm and the DRAM slab (in node.runDir, charged"),
    (("--set-string", "head.resources.limits.memory=3584Mi", "--set", "node.enabled=false"),
     "/dev/shm and the DRAM slab (in /dev/shm) count against the memory limit"),
    (("--set", "ray.podSecurityContext.runAsUser=null"), "node.enabled needs ray.podSecurityContext.runAsUser"),
    (("--set", "pool.disk.enabled=true,pool.disk.path=/var/run/kvpool/"),
     "node.runDir and pool.disk.path are the same directory"),
    (("--set", "node.runDir=run"), "node.runDir: Does not match pattern"),
    (("--set", "node.hostPath=/dev/shm/a b"), "node.hostPath: Does not match pattern"),
    (("--set", "node.enable=true"), "node: Additional property enable is not allowed"),
    (("--set", "redis.mode=external"), "redis.mode=external needs redis.external.url"),
    (("--set", "engineTenant=nobody"), 'engineTenant "nobody" is not among pool.tenants [default]'),
    (("--set", "ray.auth.mode=on"), 'ray.auth.mode: ray.auth.mode must be one of the following: "token", "disabled"'),
    (("--set", "auth.existingSecretKey=a/b"), "auth.existingSecretKey: Does not match pattern"),
    (("--set", "redis.acl=true"), "redis.acl: Invalid type. Expected: object, given: boolean"),
    (("--set", "redis.mode=external,redis.external.url=redis://r:6379/0,redis.external.shardSecretKey=s"),
     "redis.external.shardSecretKey and engineSecretKey name keys of redis.external.existingSecret"),
    (("--set-json", 'pool.tenants=[{"id":"a"},{"id":"a"}]', "--set", "engineTenant=a"),
     'pool.tenants: tenant "a" is listed twice'),
    (("--set", "warmup.enabled=true,warmup.model=demo", "--set-json", 'warmup.entries=[{"tenant":"x","tokens":[1]}]'),
     'warmup.entries: tenant "x" is not among pool.tenants [default]'),
]


@pytest.mark.parametrize("extra,message", BAD_VALUES, ids=[" ".join(e[1:]) for e, _ in BAD_VALUES])
def test_bad_values_are_rejected_with_a_clear_message(extra, message):
    err = render_error(*extra)
    assert message in err, err


def test_schema_policies_are_kvpools():
    """The schema's policy list is the one kvpool knows (`kvpool sim --policy` names): adding a
    policy to kvpool without the chart, or the reverse, fails here."""
    from kvpool.policies import policy_names

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["pool"]["properties"]["policy"]["enum"] == policy_names() == POLICIES


# ----------------------------------------------------------------------------- NOTES.txt


def render_notes(tmp_path: Path, *extra: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm template` does not render NOTES, and `helm
    install --dry-run` wants a cluster, so a copy of the chart renders it inside a ConfigMap."""
    chart = tmp_path / "kvpool"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "files" / "NOTES-under-test.txt")
    (chart / "templates" / "zz-notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-under-test\ndata:\n"
        '  notes: {{ tpl (.Files.Get "files/NOTES-under-test.txt") . | toJson }}\n')
    docs = render("default", tuple(extra), chart=str(chart))
    return one(docs, "ConfigMap", "notes-under-test")["data"]["notes"]


def _shell_words(line: str, env: dict) -> list[str]:
    """The words a POSIX shell makes of ``line`` (quotes and $VARS as the shell sees them)."""
    r = subprocess.run(["sh", "-c", f'for w in {line}; do printf "%s\\0" "$w"; done'],
                       env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\0")[:-1]


def _engine_lines(notes: str) -> tuple[str, str]:
    vllm = [ln.strip() for ln in notes.splitlines() if ln.strip().startswith("vllm serve")]
    sglang = [ln.strip() for ln in notes.splitlines() if "sglang.launch_server" in ln]
    assert len(vllm) == 1 and len(sglang) == 1, notes
    return vllm[0], sglang[0]


def test_notes_print_engine_commands_with_the_addresses(tmp_path):
    from kvpool.connectors.pools import check_config

    notes = render_notes(tmp_path)
    head = f"rel-kvpool-head.{NAMESPACE}.svc.cluster.local"
    assert f"ray://{head}:10001" in notes  # for kvpool commands; engines never use it
    assert f"http://rel-kvpool-dashboard.{NAMESPACE}.svc.cluster.local:8265" in notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/rel-kvpool-dashboard 8265" in notes
    assert f"kubectl -n {NAMESPACE} logs -f job/rel-kvpool-up-r1" in notes
    assert "-- kvpool auth issue default)" in notes
    assert "engine-password" not in notes and "RAY_AUTH_TOKEN" not in notes  # an engine needs neither
    vllm, sglang = _engine_lines(notes)
    words = _shell_words(vllm, {})
    assert words[:3] == ["vllm", "serve", "MODEL"] and words[3] == "--kv-transfer-config"
    cfg = json.loads(words[4])
    assert {k: cfg[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role")} == \
        {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm", "kv_role": "kv_both"}
    extra = cfg["kv_connector_extra_config"]
    want = {"backend": "node", "pool": "default", "tenants": ["default"], "tenant": "default", "chunk_tokens": 256,
            "start_timeout_s": 600}  # the engine pod may start before the Ray pod: it waits for its shard
    assert extra == want
    assert check_config(extra)["backend"] == "node"  # the connectors' own check accepts it

    words = _shell_words(sglang, {})
    i = words.index("--hicache-storage-backend-extra-config")
    assert words[i - 3:i] == ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic"]
    sg = json.loads(words[i + 1])
    own = {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang", "class_name": "KVPoolStorage"}
    assert {k: sg.pop(k) for k in own} == own
    assert sg == {k: v for k, v in want.items() if k != "chunk_tokens"}
    check_config(sg)


def _engine_pod(notes: str) -> dict | None:
    """The engine pod spec NOTES.txt prints for backend "node" (between its marker comments)."""
    lines = notes.splitlines()
    if "# --- engine pod spec ---" not in lines:
        return None
    start = lines.index("# --- engine pod spec ---")
    return yaml.safe_load("\n".join(lines[start + 1:lines.index("# --- end ---")]))["spec"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_notes_engine_pod_for_the_node_backend(tmp_path, value_set):
    """The snippet an operator adds to a vLLM Deployment: the Ray pods' node directory at the same
    path, $KVPOOL_RUN_DIR, the Ray pods' user, a node with a Ray worker of this release, and a
    backend "node" config the connectors accept; no Ray address, token or index URL."""
    from kvpool.connectors.pools import check_config

    vals = values_of(value_set)
    args = () if value_set == "default" else ("-f", str(CHART / value_set))
    notes = render_notes(tmp_path, *args)
    pod = _engine_pod(notes)
    if not vals["node"]["enabled"]:
        assert pod is None and "needs node.enabled" in notes  # no engine pod to run: it says why
        return
    rc = one(render(value_set), "RayCluster")
    ray_pod = ray_pod_specs(rc)[vals["worker"]["groupName"]]
    ray_vols = {v["name"]: v for v in ray_pod["spec"]["volumes"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["kvpool-run"]["hostPath"] == ray_vols["run-dir"]["hostPath"]
    assert pod["securityContext"] == {k: v for k, v in ray_pod["spec"]["securityContext"].items()
                                      if k in ("runAsUser", "runAsGroup")}
    term = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["namespaces"] == [NAMESPACE]
    assert labels_match(term["labelSelector"]["matchLabels"], ray_pod["metadata"]["labels"])
    assert not labels_match(term["labelSelector"]["matchLabels"], ray_pod_specs(rc)["head"]["metadata"]["labels"])
    (c,) = pod["containers"]
    run_dir = vals["node"]["runDir"]
    assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]} == {run_dir: "kvpool-run"}
    env = {e["name"]: e for e in c["env"]}
    assert env["KVPOOL_RUN_DIR"]["value"] == run_dir
    secret = f"kvpool-engine-{vals['engineTenant']}"
    assert env["KVPOOL_CREDENTIAL"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "credential"}
    assert f"create secret generic {secret} --from-literal=credential=" in notes
    assert f"kvpool auth issue {vals['engineTenant']})\"" in notes
    assert c["command"] == ["vllm", "serve"] and c["args"][:2] == ["MODEL", "--kv-transfer-config"]
    cfg = json.loads(c["args"][2])
    assert {k: cfg[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role")} == \
        {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.connectors.vllm", "kv_role": "kv_both"}
    extra = cfg["kv_connector_extra_config"]
    tenants = [t["id"] for t in vals["pool"]["tenants"]]
    assert extra == {"backend": "node", "pool": "default", "chunk_tokens": vals["pool"]["chunkTokens"],
                     "tenants": tenants, "tenant": vals["engineTenant"],
                     "start_timeout_s": vals.get("engineStartTimeoutS", 600)}
    assert check_config(extra)["backend"] == "node"
    # the chart's image (helm/image/Dockerfile: vLLM's with kvpool), and the pod part validates as a PodSpec
    assert c["image"] == f"{vals['image']['repository']}:{vals['image']['tag'] or '0.1.0'}"
    try:
        import kubernetes_validate
    except ImportError:
        return
    podspec = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine"}, "spec": pod}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(podspec, version, strict=True)


def test_notes_with_external_redis_in_a_secret(tmp_path):
    notes = render_notes(tmp_path, "-f", str(CHART / "ci" / "external-redis-values.yaml"))
    assert "ray://kvp-head.kv.svc.cluster.example:10001" in notes
    assert "engine-url" not in notes  # engines never reach Redis: their node's shard does
    vllm, _ = _engine_lines(notes)
    cfg = json.loads(_shell_words(vllm, {})[4])
    assert cfg["kv_connector_extra_config"]["backend"] == "node" and "index_url" not in cfg["kv_connector_extra_config"]


# ----------------------------------------------------------------------------- Grafana dashboard


@functools.cache
def exported_series() -> dict[str, set[str]]:
    """Every Prometheus series kvpool exports through Ray, with its labels: Ray prefixes `ray_`,
    counters get `_total`, the get-latency histogram its `_bucket`, `_sum`, `_count` (as Ray 2.60's
    metrics endpoint showed for a RayExporter here: ray_kvpool_hits_chunks_total{shard, tenant},
    ray_kvpool_pages_total{shard, tier}, ray_kvpool_get_latency_ms_bucket{shard, transport, le})."""
    from kvpool.metrics import Metrics

    out = {}
    for m in Metrics():
        name = f"ray_kvpool_{m.name}" + ("_total" if m.kind == "counter" else "")
        out[name] = {"shard", *m.labels}
    src = (REPO / "cluster" / "metrics.py").read_text()
    (hist,) = re.findall(r'Histogram\(\s*"(kvpool_[a-z_]+)"', src)
    tags = set(re.findall(r'tag_keys=\("shard", "([a-z_]+)"\)\)', src))
    assert tags == {"transport"}, tags
    for suffix in ("_bucket", "_sum", "_count"):
        out[f"ray_{hist}{suffix}"] = {"shard", "transport"} | ({"le"} if suffix == "_bucket" else set())
    return {**out, **router_series()}


def router_series() -> dict[str, set[str]]:
    """The router's own series (`kvpool route`'s /metrics, prometheus_client's names), with labels."""
    from kvpool.connectors.route.figures import Figures

    out = {}
    for m in vars(Figures()).values():
        kind = getattr(m, "_type", None)
        if kind is None:
            continue
        labels = set(m._labelnames)
        if kind == "counter":
            out[f"{m._name}_total"] = labels
        elif kind == "histogram":
            out.update({f"{m._name}_bucket": labels | {"le"}, f"{m._name}_sum": labels, f"{m._name}_count": labels})
        else:
            out[m._name] = labels
    return out


def _dashboard() -> dict:
    return json.loads((CHART / "dashboards" / "kvpool.json").read_text())


def _exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


EXTRA_LABELS = {"ray_io_cluster", "le"}  # added by the monitors' relabeling, and histogram buckets
PROMQL_WORDS = {"sum", "rate", "increase", "histogram_quantile", "by", "without", "on", "ignoring", "group_left",
                "avg", "max", "min", "count"}


def test_dashboard_uses_only_exported_metrics_and_labels():
    series = exported_series()
    dash = _dashboard()
    exprs = _exprs(dash)
    assert len(exprs) >= 15
    used = set()
    for title, expr in exprs:
        names = set(re.findall(r"\b((?:ray_kvpool|kvpool_route)_[a-z_]+)\b", expr))
        assert names, f"{title}: {expr}"
        unknown = names - set(series)
        assert not unknown, f"panel {title!r} reads {unknown}, which kvpool does not export"
        used |= names
        labels = set().union(*(series[n] for n in names)) | EXTRA_LABELS
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert label in labels, f"panel {title!r} groups by {label!r}, not a label of {names}"
        for label in re.findall(r"([a-z_]+)\s*=~?\s*\"", expr):
            assert label in labels, f"panel {title!r} filters on {label!r}"
        words = set(re.findall(r"\b([a-z_]+)\s*\(", expr))
        assert words <= PROMQL_WORDS, f"{title}: {words - PROMQL_WORDS}"
        assert expr.count("(") == expr.count(")"), expr
    # What the issue asks to see: hit rate, evictions/s vs pages, occupancy by tier and tenant,
    # 429s, cancellations, get latency.
    need = {"ray_kvpool_hits_chunks_total", "ray_kvpool_misses_chunks_total", "ray_kvpool_evictions_total",
            "ray_kvpool_pages_total", "ray_kvpool_chunks", "ray_kvpool_tenant_bytes", "ray_kvpool_rejected_quota_total",
            "ray_kvpool_cancelled_requests_total", "ray_kvpool_get_latency_ms_bucket",
            # and the router's: where requests went (by outcome, by the tier expected), TTFT, instances
            "kvpool_route_requests_total", "kvpool_route_prompt_tokens_total", "kvpool_route_ttft_seconds_bucket",
            "kvpool_route_instance_up"}
    assert need <= used, need - used
    by_title = {}
    for t, e in exprs:
        by_title.setdefault(t, e)  # a panel's first query
    assert "by (tier)" in by_title["Occupancy by tier"] and "by (tenant)" in by_title["Occupancy by tenant"]
    assert re.search(r"evictions_total.*\) / sum by \(tier\) \(ray_kvpool_pages_total",
                     by_title["Evictions/s vs pages"])


def test_dashboard_is_well_formed():
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] and dash["title"] == "kvpool"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "cluster", "shard"}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'ray_io_cluster=~"$cluster"' in t["expr"], t["expr"]
            # the router is no shard's: its series carry the cluster (its monitor's relabeling) only
            assert ('shard=~"$shard"' in t["expr"]) is ("kvpool_route_" not in t["expr"]), t["expr"]
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))


def test_dashboard_configmap_for_the_grafana_sidecar():
    assert not [d for d in render() if d["metadata"]["name"].endswith("-dashboard") and d["kind"] == "ConfigMap"]
    docs = render("ci/full-values.yaml")
    cm = one(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "kvpool"}
    assert json.loads(cm["data"]["kvpool.json"]) == _dashboard()


# ----------------------------------------------------------------------------- get-helm.sh


def test_get_helm_is_idempotent_and_fails_clearly(tmp_path):
    script = REPO / "helm" / "get-helm.sh"
    r = subprocess.run(["bash", str(script)], env={**os.environ, "VENV": str(tmp_path / "none")}, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1 and f"no virtualenv at {tmp_path / 'none'}" in r.stderr
    venv = REPO / ".venv"
    if not (venv / "bin" / "helm").exists():
        _missing("no .venv/bin/helm: run `bash helm/get-helm.sh`")
    # In place already: nothing is downloaded.
    r = subprocess.run(["bash", str(script)], env={**os.environ, "VENV": str(venv)}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and "is already helm v3.17.2" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- the router


def test_the_router_runs_the_real_cli_beside_a_shard_with_its_credentials(tmp_path):
    """`kvpool route` with flags the CLI has and a --config the connectors' check takes, on a node
    of the pool (its run dir, the Ray pods' user), its credentials 0400, scraped with its cluster."""
    from kvpool.cli import build_parser
    from kvpool.connectors.route.fleet import InstanceSpec
    from kvpool.connectors.route.main import read_config
    from kvpool.connectors.vllm_config import split_config

    vals = values_of("ci/full-values.yaml")
    docs = render("ci/full-values.yaml")
    dep = one(docs, "Deployment", "-router")
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    args = build_parser().parse_args(["route", *c["args"]])
    r = vals["router"]
    assert c["command"] == ["kvpool", "route"] and args.func.__name__ == "_route"
    assert (args.host, args.port, args.policy, args.model, args.dtype) == ("0.0.0.0", 8000, "tier-aware",
                                                                            r["model"], r["dtype"])
    assert [InstanceSpec.parse(i) for i in args.instance] == [InstanceSpec(i["url"], i.get("shard", ""))
                                                               for i in r["instances"]]
    cfg, own = split_config(read_config(args.config))
    assert cfg["backend"] == "node" and cfg["tenants"] == ["default", "team-a"] and own == {}
    assert cfg["chunk_tokens"] == vals["pool"]["chunkTokens"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert os.path.dirname(cfg["credentials_file"]) == mounts["credentials"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["credentials"]["secret"] == {"secretName": "kvpool-router-credentials", "defaultMode": 0o400,
                                             "items": [{"key": "credentials.json", "path": "credentials.json"}]}
    assert vols["run-dir"]["hostPath"]["path"] == vals["node"]["hostPath"] and mounts["run-dir"] == vals["node"]["runDir"]
    assert {"name": "KVPOOL_RUN_DIR", "value": vals["node"]["runDir"]} in c["env"]
    assert spec["securityContext"]["runAsUser"] == vals["ray"]["podSecurityContext"]["runAsUser"]
    term = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "ray-worker"
    svc = one(docs, "Service", "-router")
    assert labels_match(svc["spec"]["selector"], pod["metadata"]["labels"]) and svc["spec"]["type"] == "LoadBalancer"
    mon = one(docs, "PodMonitor", "-router")
    assert labels_match(mon["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (ep,) = mon["spec"]["podMetricsEndpoints"]
    assert (ep["port"], ep["path"]) == ("http", "/metrics")
    assert ep["relabelings"][0]["targetLabel"] == "ray_io_cluster"
    assert pod["metadata"]["labels"]["kvpool.io/cluster"] == fullname("ci/full-values.yaml")
    assert not [d for d in render() if d["kind"] == "Deployment"]  # off by default


@pytest.mark.parametrize("extra,message", [
    (("--set", "router.enabled=true,router.credentialsSecret=c"), "router.instances: name at least one vLLM server"),
    (("--set", "router.enabled=true,router.instances[0].url=http://v:8000"), "router.credentialsSecret: a Secret"),
    (("--set", "router.enabled=true,router.instances[0].url=http://v:8000,router.credentialsSecret=c,"
      "node.enabled=false"), "router.enabled needs node.enabled"),
    (("--set", "router.instances[0].url=v:8000"), "router.instances.0.url: Does not match pattern"),
    (("--set", "router.policy=random"), "router.policy: router.policy must be one of the following"),
])
def test_bad_router_values_are_refused_with_the_fix(extra, message):
    err = render_error(*extra)
    assert message in err, err
