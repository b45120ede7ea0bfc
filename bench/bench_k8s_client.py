"""Which async Kubernetes client dp's DRA front end should use: lightkube or kubernetes_asyncio.

Installs nothing: both must already be installed (`pip install lightkube kubernetes_asyncio`).
For each client, in fresh interpreters, it measures:

- import time of what dp would import (the client, the resource.k8s.io/v1
  ResourceSlice and ResourceClaim models, core/v1 Node), median and p99 of N runs;
- the RSS after that import, median of N runs (and the bare interpreter's, for reference);
- whether its models are typed: mypy --strict on a snippet that assigns a
  ResourceSlice's `spec.pool.generation` (an int) to a `str`. A typed model
  makes mypy report it; an untyped one (Any) lets it through. The presence of
  `py.typed` is printed beside it.

    python3 bench/bench_k8s_client.py [--runs 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# What the DRA front end imports from each client.
IMPORTS = {
    "lightkube": (
        "from lightkube import AsyncClient, ApiError\n"
        "from lightkube.resources.resource_v1 import ResourceSlice, ResourceClaim\n"
        "from lightkube.resources.core_v1 import Node\n"
        "from lightkube.models import resource_v1, meta_v1\n"
    ),
    "kubernetes_asyncio": (
        "from kubernetes_asyncio import client, config, watch\n"
        "from kubernetes_asyncio.client import ResourceV1Api, CoreV1Api, ApiClient\n"
        "from kubernetes_asyncio.client import V1ResourceSlice, ResourceV1ResourceClaim, V1Node\n"
    ),
}

# A deliberate type error: a typed model makes mypy reject it.
TYPING_SNIPPETS = {
    "lightkube": (
        "from lightkube.resources.resource_v1 import ResourceSlice\n"
        "from lightkube.models.resource_v1 import ResourceSliceSpec, ResourcePool\n"
        "s = ResourceSlice(spec=ResourceSliceSpec(driver='d', pool=ResourcePool("
        "name='n', generation=1, resourceSliceCount=1)))\n"
        "wrong: str = s.spec.pool.generation\n"
    ),
    "kubernetes_asyncio": (
        "from kubernetes_asyncio.client import V1ResourceSlice, V1ResourceSliceSpec, "
        "V1ResourcePool\n"
        "s = V1ResourceSlice(spec=V1ResourceSliceSpec(driver='d', pool=V1ResourcePool("
        "name='n', generation=1, resource_slice_count=1)))\n"
        "wrong: str = s.spec.pool.generation\n"
    ),
}

_PROBE = """
import time, sys
t0 = time.perf_counter()
exec(compile(sys.argv[1], "<imports>", "exec"))
t1 = time.perf_counter()
rss = 0
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
print(t1 - t0, rss)
"""


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def measure_import(code: str, runs: int) -> tuple[list[float], list[int]]:
    times: list[float] = []
    rss: list[int] = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, code], check=True, capture_output=True, text=True
        ).stdout.split()
        times.append(float(out[0]))
        rss.append(int(out[1]))
    return times, rss


def typed(name: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snippet.py"
        path.write_text(TYPING_SNIPPETS[name])
        done = subprocess.run(
            [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(path)],
            capture_output=True,
            text=True,
        )
    lines = [line for line in done.stdout.splitlines() if "error" in line]
    caught = any("Incompatible types in assignment" in line for line in lines)
    return caught, lines[0] if lines else done.stdout.strip().splitlines()[-1]


def has_py_typed(package: str) -> bool:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None
    return (Path(spec.origin).parent / "py.typed").exists()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    for name in IMPORTS:
        if importlib.util.find_spec(name) is None:
            sys.exit(f"{name} is not installed: pip install lightkube kubernetes_asyncio")
    results = {}
    _, base_rss = measure_import("pass", max(5, args.runs // 3))
    results["python (nothing imported)"] = {"rss_mib_median": statistics.median(base_rss) / 1024}
    for name, code in IMPORTS.items():
        times, rss = measure_import(code, args.runs)
        caught, line = typed(name)
        results[name] = {
            "import_ms_median": round(statistics.median(times) * 1000, 1),
            "import_ms_p99": round(_p99(times) * 1000, 1),
            "rss_mib_median": round(statistics.median(rss) / 1024, 1),
            "py_typed": has_py_typed(name),
            "mypy_catches_model_type_error": caught,
            "mypy_says": line,
        }
    print(json.dumps({"runs": args.runs, "python": sys.version.split()[0], **results}, indent=2))


if __name__ == "__main__":
    main()
