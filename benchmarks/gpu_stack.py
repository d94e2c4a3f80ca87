"""Build ``.gpu-stack/``: the Python packages the engine e2e (tests/engine/run_engine.py on the vllm-ascend platform)
needs on the GPU box, which has torch (CUDA) + Triton and nothing of vLLM's, and no network. The device tool carries
the folder beside the repo (``carry=[".gpu-stack"]``, 64 MiB with the working tree); on the box
``PYTHONPATH=.gpu-stack:tests/support:.`` makes it importable (benchmarks/bench_engine_gpu.py sets that up).

    python benchmarks/gpu_stack.py --python 3.12 [--release 0.18.0] [--site /work/main/.tox/va018/lib/python3.11/site-packages]

What goes in (docs/environments.md, "GPU box"):

* vLLM and vllm-ascend of ``--release``: their pure-Python sources only (every compiled file dropped: vLLM's CUDA
  kernels are built for another torch and never load beside the box's, vllm-ascend's need CANN), byte-identical
  otherwise (zb-patch fingerprints upstream source), with their dist-info (versions, entry points: the ``ascend``
  platform plugin). Taken from ``--site`` (an installed env of that release) or else downloaded.
* the packages the engine path imports unconditionally (``PACKAGES``, found by running the engine in a venv holding
  only torch + triton + numpy, the box's set), at the versions of ``requirements/<env>.txt`` (the release's tested
  lock), as the target Python's wheels (``pip download``: compiled ones must match the box's ``--python``).
* ``zb_patch-<version>.dist-info`` with zb-patch's entry point (the package itself is the repo's, on PYTHONPATH).
* ``STACK.json``: release, target Python, every distribution with its version and wheel, the sizes.

Left out on purpose: what the box has (torch and its dependencies, triton, numpy: ``BOX_HAS``), what the path imports
only when present (scipy, opencv, pillow, numba, ... : vLLM / transformers / vllm-ascend probe for them; see
``OPTIONAL``), tests, ``__pycache__``, compiled files of source-only packages, model files vLLM never imports here
(``transformers/models/*`` outside ``KEEP_TRANSFORMERS_MODELS``).

Wheels are cached in ``~/.cache/zb-patch/gpu-stack/`` (``--wheels``); building needs network to PyPI (this machine),
the box does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# release -> the tox env whose lock pins its packages
LOCKS = {"0.13.0": "va013", "0.18.0": "va018", "0.23.0": "va023"}

# vLLM and vllm-ascend: sources only (their compiled extensions cannot load on the box).
SOURCE_ONLY = ("vllm", "vllm-ascend")

# Distributions the engine path imports unconditionally (besides SOURCE_ONLY), with the import that needs each.
# Found by running tests/engine/run_engine.py in a venv holding only BOX_HAS + this stack (docs/environments.md).
PACKAGES: dict[str, str] = {
    "transformers": "vllm.config (model configs, tokenizer base classes)",
    "tokenizers": "transformers.tokenization_utils_base",
    "huggingface-hub": "transformers.utils",
    "safetensors": "transformers.modeling_utils; tests/engine/tiny_model.py writes the weights",
    "pyyaml": "huggingface_hub.utils._fixes",
    "requests": "huggingface_hub.hf_api",
    "urllib3": "requests; vllm.utils.network_utils",
    "idna": "requests",
    "certifi": "requests",
    "charset-normalizer": "requests",
    "tqdm": "transformers, huggingface_hub",
    "packaging": "vllm.utils.torch_utils, transformers, zb_patch",
    "wrapt": "zb_patch.registry",
    "pydantic": "vllm.config",
    "pydantic-core": "pydantic",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "regex": "vllm.utils.import_utils",
    "psutil": "vllm.utils.network_utils",
    "pyzmq": "vllm.utils.network_utils",
    "cbor2": "vllm.utils.hashing",
    "msgspec": "vllm.distributed.kv_events",
    "cloudpickle": "vllm.v1.serial_utils",
    "cachetools": "vllm.utils.cache",
    "py-cpuinfo": "vllm.usage.usage_lib",
    "prometheus-client": "vllm.v1.metrics",
    "einops": "vllm.v1.attention.ops.vit_attn_wrappers",
    "pybase64": "vllm.multimodal.media.audio",
    "aiohttp": "vllm.connections",
    "aiohappyeyeballs": "aiohttp",
    "aiosignal": "aiohttp",
    "attrs": "aiohttp",
    "frozenlist": "aiohttp",
    "multidict": "aiohttp",
    "propcache": "aiohttp (yarl)",
    "yarl": "aiohttp",
    "openai": "vllm.entrypoints.mcp.tool (vllm.reasoning)",
    "openai-harmony": "vllm.entrypoints.mcp.tool_server (vllm.reasoning)",
    "httpx": "openai",
    "httpcore": "httpx",
    "h11": "httpcore",
    "anyio": "openai, httpx",
    "sniffio": "openai",
    "distro": "openai",
    "jiter": "openai",
    "partial-json-parser": "vllm.tool_parsers.utils",
    "ijson": "vllm.tool_parsers.mistral_tool_parser",
    "diskcache": "vllm.v1.structured_output.utils",
    "compressed-tensors": "vllm_ascend.quantization.compressed_tensors_config",
    "loguru": "compressed_tensors",
    "fastapi": "vllm.entrypoints.pooling; vllm_ascend.model_loader.rfork.seed_server",
    "starlette": "fastapi",
    "annotated-doc": "fastapi",
    "uvicorn": "vllm_ascend.model_loader.rfork.seed_server",
    "click": "uvicorn",
    "gguf": "vllm.transformers_utils.gguf_utils",
    "pillow": "vllm.multimodal.hasher",
    "llguidance": "vllm.v1.structured_output.backend_guidance (class-body annotations resolve the lazy module)",
    "xgrammar": "vllm.v1.structured_output.backend_xgrammar (dataclass field annotations)",
    "apache-tvm-ffi": "xgrammar",
}

# Provided by the box (torch's own dependencies, triton, numpy): never carried. The probe (benchmarks/gpu_probe.sh)
# lists the box's packages; bench_engine_gpu.py checks these import before anything else.
BOX_HAS = (
    "torch",
    "triton",
    "numpy",
    "filelock",
    "typing-extensions",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "setuptools",
)

# Imported on this path only when installed (availability probes), so left out: the path runs without them.
OPTIONAL = (
    "scipy",  # transformers.loss.loss_for_object_detection: is_scipy_available()
    "opencv-python-headless",  # mistral_common image tokenizer: is_opencv_installed()
    "numba",  # vllm_ascend.eplb.core.policy.policy_flashlb imports it: see tests/support/gpu_box (absent-package stand-in)
)

# transformers/models/<name> subpackages the engine path imports (vLLM's model registry and vllm-ascend's model
# patches import these configs / processors); every other model is dropped.
KEEP_TRANSFORMERS_MODELS = (
    "auto",
    "bert",
    "clip",
    "deepseek_v2",
    "deepseek_v3",
    "encoder_decoder",
    "gemma3",
    "llama",
    "qwen2",
    "qwen2_5_vl",
    "qwen2_moe",
    "qwen2_vl",
    "qwen3",
    "qwen3_vl",
    "siglip",
    "whisper",
)

# In SOURCE_ONLY packages: data directories the engine path never reads (MoE / quantisation tuning tables, the
# OpenAPI UI assets, Ascend custom-op binaries).
DROP_DIRS = (
    "vllm/entrypoints/serve/instrumentator",
    "vllm/model_executor/layers/fused_moe/configs",
    "vllm/model_executor/layers/quantization/utils/configs",
    "vllm/kernels/helion/configs",
    "vllm_ascend/_cann_ops_custom",
)
COMPILED = re.compile(r"\.(so(\.\d+)*|pyd|o|a|dll|dylib)$")
DROP_FILES = re.compile(r"(\.(pyc|pyi|jpg|png|md)$|/py\.typed$)")

DEFAULT_WHEELS = os.path.join(os.path.expanduser("~"), ".cache", "zb-patch", "gpu-stack")
# manylinux tags the box's glibc (Ubuntu 24.04: 2.39) runs; pip needs them spelled out for a foreign target
PLATFORMS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)


def lock_versions(release: str) -> dict[str, str]:
    env = LOCKS.get(release)
    if env is None:
        raise SystemExit(f"gpu_stack: no lock for release {release} (known: {', '.join(LOCKS)})")
    pins = {}
    with open(os.path.join(REPO, "requirements", f"{env}.txt")) as fh:
        for line in fh:
            m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
            if m:
                pins[canonical(m.group(1))] = m.group(2)
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(dist: str, version: str, python: str, dest: str) -> str:
    """The wheel of ``dist==version`` for CPython ``python`` on x86_64 Linux (cached in ``dest``)."""
    os.makedirs(dest, exist_ok=True)
    have = find_wheel(dest, dist, version)
    if have:
        return have
    tag = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", dest]
    cmd += ["--python-version", python, "--implementation", "cp", "--abi", tag, "--abi", "abi3", "--abi", "none"]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run([*cmd, f"{dist}=={version}"], check=True)
    have = find_wheel(dest, dist, version)
    if not have:
        raise SystemExit(f"gpu_stack: pip downloaded no wheel for {dist}=={version} into {dest}")
    return have


def find_wheel(dest: str, dist: str, version: str) -> str | None:
    stem = canonical(dist).replace("-", "_")
    for name in sorted(os.listdir(dest)) if os.path.isdir(dest) else []:
        parts = name.split("-")
        if name.endswith(".whl") and canonical(parts[0]).replace("-", "_") == stem and parts[1] == version:
            return os.path.join(dest, name)
    return None


def keep(relpath: str, source_only: bool) -> bool:
    parts = relpath.split("/")
    if "__pycache__" in parts or "tests" in parts[1:] or DROP_FILES.search(relpath):
        return False
    if parts[0].endswith(".dist-info"):
        return parts[-1] in ("METADATA", "entry_points.txt", "top_level.txt")
    if parts[0] == "transformers" and len(parts) > 3 and parts[1] == "models":
        return parts[2] in KEEP_TRANSFORMERS_MODELS
    if source_only:
        if COMPILED.search(relpath) or any(relpath.startswith(d + "/") for d in DROP_DIRS):
            return False
    return True


def unpack_wheel(wheel: str, out: str, source_only: bool) -> list[str]:
    written = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or ".data/" in name.split("/", 1)[0] + "/" or not keep(name, source_only):
                continue
            target = os.path.join(out, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if info.external_attr >> 16 & 0o111:
                os.chmod(target, 0o755)
            written.append(name)
    return written


def copy_installed(site: str, dist: str, version: str, out: str) -> list[str]:
    """A SOURCE_ONLY distribution from an installed env: the files its RECORD lists (so nothing else of the site)."""
    stem = canonical(dist).replace("-", "_")
    info = os.path.join(site, f"{stem}-{version}.dist-info")
    if not os.path.isdir(info):
        raise SystemExit(f"gpu_stack: {info} not found (--site must hold {dist}=={version})")
    written = []
    with open(os.path.join(info, "RECORD")) as fh:
        for line in fh:
            rel = line.rsplit(",", 2)[0]
            if rel.startswith("..") or os.path.isabs(rel) or not keep(rel, True):
                continue
            src = os.path.join(site, rel)
            if not os.path.isfile(src):
                continue
            dst = os.path.join(out, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
            written.append(rel)
    return written


def zb_patch_dist_info(out: str) -> str:
    """zb-patch's metadata and entry point, so vLLM loads the repo's zb_patch as a general plugin on the box."""
    with open(os.path.join(REPO, "zb_patch", "__init__.py")) as fh:
        version = re.search(r'^__version__\s*=\s*"([^"]+)"', fh.read(), re.M).group(1)
    info = os.path.join(out, f"zb_patch-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: zb-patch\nVersion: {version}\n")
    with open(os.path.join(REPO, "pyproject.toml")) as fh:
        name, target = re.search(
            r'\[project\.entry-points\."vllm\.general_plugins"\]\s*\n(\w+)\s*=\s*"([^"]+)"', fh.read()
        ).groups()
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        fh.write(f"[vllm.general_plugins]\n{name} = {target}\n")
    return version


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the box's Python major.minor (benchmarks/gpu_probe.sh prints it)")
    ap.add_argument("--release", default="0.18.0", choices=sorted(LOCKS))
    ap.add_argument("--out", default=os.path.join(REPO, ".gpu-stack"))
    ap.add_argument("--site", help="site-packages of an installed env of the release (vLLM / vllm-ascend sources)")
    ap.add_argument("--wheels", default=DEFAULT_WHEELS, help="wheel cache")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        raise SystemExit(f"gpu_stack: --python {args.python!r}: give major.minor, e.g. 3.12")

    pins = lock_versions(args.release)
    if pins.get("vllm-ascend") != args.release:
        raise SystemExit(f"gpu_stack: the lock pins vllm-ascend {pins.get('vllm-ascend')}, not {args.release}")
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    wheels = os.path.join(args.wheels, "cp" + args.python.replace(".", ""))
    manifest: dict = {"release": args.release, "python": args.python, "dists": {}}
    for dist in (*SOURCE_ONLY, *PACKAGES):
        version = pins.get(canonical(dist))
        if version is None:
            raise SystemExit(f"gpu_stack: {dist} is not in requirements/{LOCKS[args.release]}.txt")
        source_only = dist in SOURCE_ONLY
        if source_only and args.site:
            files, origin = copy_installed(args.site, dist, version, args.out), args.site
        else:
            wheel = download(dist, version, args.python, wheels)
            files, origin = unpack_wheel(wheel, args.out, source_only), os.path.basename(wheel)
        compiled = sorted(f for f in files if COMPILED.search(f))
        manifest["dists"][dist] = {"version": version, "from": origin, "files": len(files), "compiled": compiled}
    manifest["zb_patch"] = zb_patch_dist_info(args.out)
    manifest["bytes"] = tree_bytes(args.out)
    repo_files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    manifest["repo_bytes"] = sum(os.path.getsize(os.path.join(REPO, f)) for f in repo_files if os.path.isfile(
        os.path.join(REPO, f)))
    digest = hashlib.sha256(json.dumps(manifest["dists"], sort_keys=True).encode()).hexdigest()[:16]
    manifest["digest"] = digest
    with open(os.path.join(args.out, "STACK.json"), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    mib = 1 << 20
    print(f"{args.out}: {manifest['bytes'] / mib:.1f} MiB ({len(manifest['dists'])} distributions, python {args.python},"
          f" release {args.release}); repo working tree {manifest['repo_bytes'] / mib:.1f} MiB;"
          f" together {(manifest['bytes'] + manifest['repo_bytes']) / mib:.1f} MiB of the 64 MiB carry limit")
    biggest = sorted(
        ((tree_bytes(os.path.join(args.out, d)), d) for d in os.listdir(args.out) if os.path.isdir(
            os.path.join(args.out, d))), reverse=True)[:12]
    for size, d in biggest:
        print(f"  {size / mib:6.1f} MiB  {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
