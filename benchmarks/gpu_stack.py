"""Build ``.gpu-stack/``: the Python packages the engine e2e (the vllm-ascend platform over CUDA, benchmarks/
bench_engine_gpu.py) needs on the GPU machine, which has torch (CUDA) + Triton + numpy and nothing of vLLM's, and no
network. The device tool carries the folder beside the repo (``carry=[".gpu-stack"]``, 64 MiB with the working tree).

    python benchmarks/gpu_stack.py --python 3.12 [--release 0.18.0] [--site <site-packages of a va018 env>]

The folder holds ``STACK.json`` (release, target Python, every distribution with its version and origin, sizes, the
archive's sha256) and ``stack-<release>-cp<XY>.tar.xz``; on the GPU machine :func:`unpack` extracts it once per digest
(bench_engine_gpu.py: into ``.gpu-stack-unpacked/``, refusing another Python than the one it was built for) and
``PYTHONPATH=<unpacked>:tests/support:.`` makes it importable. What goes in (docs/environments.md, "GPU machine"):

* vLLM and vllm-ascend of ``--release``: their pure-Python sources only (every compiled file dropped: vLLM's CUDA
  kernels are built for another torch and never load beside the GPU machine's, vllm-ascend's need CANN), byte-identical
  otherwise (zb-patch fingerprints upstream source), with their dist-info (versions, entry points: the ``ascend``
  platform plugin). Taken from ``--site`` (an installed env of that release) or else downloaded.
* the packages the engine path imports unconditionally (``PACKAGES``, found by running the engine in a venv holding
  only torch + triton + numpy, the GPU host's set), at the versions of ``requirements/<env>.txt`` (the release's tested
  lock), as the target Python's wheels (``pip download``: compiled ones must match the GPU machine's ``--python``).
* ``zb_patch-<version>.dist-info`` with zb-patch's entry point (the package itself is the repo's, on PYTHONPATH).

Left out on purpose: what the host has (``BOX_HAS``: torch and its dependencies, triton, numpy), what the path imports
only when present (``OPTIONAL``), numba and scipy (``STAND_INS``), tests, ``__pycache__``, compiled files and unread
data of the source-only packages (``DROP_DIRS``), transformers models vLLM never imports here (outside
``KEEP_TRANSFORMERS_MODELS``). When ``python<X.Y>`` exists here, every compiled package of the stack is imported with
it as a check.

Wheels are cached in ``~/.cache/zb-patch/gpu-stack/`` (``--wheels``); building needs network to PyPI (this machine),
the GPU machine does not.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "STACK.json"
MIB = 1 << 20

# release -> the tox env whose lock pins its packages
LOCKS = {"0.13.0": "va013", "0.18.0": "va018", "0.23.0": "va023"}

# vLLM and vllm-ascend: sources only (their compiled extensions cannot load on the GPU machine).
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
    "typing-extensions": "anyio, pydantic, ... (anyio 4.16 needs >= 4.16: carried: the host's copy is older)",
    "llguidance": "vllm.v1.structured_output.backend_guidance (class-body annotations resolve the lazy module)",
    "xgrammar": "vllm.v1.structured_output.backend_xgrammar (dataclass field annotations)",
    "apache-tvm-ffi": "xgrammar",
    # imported on the 0.23 path only (found by listing the site-packages modules a va023-e2e engine process imported
    # against the 0.18 list; docs/environments.md)
    "uvloop": "vllm.v1.utils (0.23)",
    "pandas": "vllm_ascend.core.scheduler_dynamic_batch (0.23)",
    "python-dateutil": "pandas",
    "httpx2": "openai (0.23's lock: openai 3.x)",
    "h2": "httpx2",
    "hpack": "h2",
    "hyperframe": "h2",
    "jmespath": "imported by the 0.23 engine process (va023-e2e)",
    # 0.23: vllm_ascend.patch.platform.patch_glm_tool_call_streaming imports vLLM's OpenAI chat serving
    "mistral-common": "vllm.tool_parsers.mistral_tool_parser (0.23)",
    "pydantic-extra-types": "mistral_common",
    "pycountry": "pydantic_extra_types",
    "tiktoken": "mistral_common.tokens",
    "jsonschema": "mistral_common",
    "jsonschema-specifications": "jsonschema",
    "referencing": "jsonschema",
    "rpds-py": "referencing",
    # imported on the 0.13 path only (the same listing against va013-e2e)
    "blake3": "vllm.utils.hashing (0.13)",
    "interegular": "lmformatenforcer (0.13)",
    "lm-format-enforcer": "vllm.v1.structured_output (0.13)",
}

# Provided by the GPU host (torch's own dependencies, triton, numpy): never carried. The probe (benchmarks/gpu_probe.sh)
# lists the GPU machine's packages; bench_engine_gpu.py checks these import before anything else.
BOX_HAS = (
    "torch",
    "triton",
    "numpy",
    "filelock",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "setuptools",
)

# Not carried although the path imports them (each ~20-150 MB unpacked): only EPLB's FlashLB policy and n-gram
# drafting use them, neither runs here; tests/support/gpu_box/absent holds stand-ins that import and raise when used
# (bench_engine_gpu.py puts them on the path only where the real package is missing).
STAND_INS = ("numba", "scipy")
# Imported on this path only when installed (availability probes): the path runs without them.
OPTIONAL = (
    "opencv-python-headless",  # mistral_common image tokenizer: is_opencv_installed()
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
    "glm4_moe",  # 0.23: vllm_ascend.patch.worker.patch_gqa_c8 imports vLLM's glm4_moe model, which imports its config
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
    "vllm/third_party/deep_gemm/include",  # 0.23: DeepGEMM's CUDA headers, read only by its JIT compiler
)
COMPILED = re.compile(r"\.(so(\.\d+)*|pyd|o|a|dll|dylib)$")
# static archives (read by a linker, never loaded) and vLLM 0.23's optional Rust front end (VLLM_RUST_FRONTEND_PATH)
DROP_FILES = re.compile(r"(\.(pyc|pyi|jpg|png|md|a)$|/py\.typed$|^vllm/vllm-rs$)")

DEFAULT_WHEELS = os.path.join(os.path.expanduser("~"), ".cache", "zb-patch", "gpu-stack")
# manylinux tags the GPU machine's glibc (Ubuntu 24.04: 2.39) runs; pip needs them spelled out for a foreign target
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
        # RECORD: tvm_ffi (xgrammar 0.2, vllm-ascend 0.23's lock) finds a package's shared libraries through it
        return parts[-1] in ("METADATA", "entry_points.txt", "top_level.txt", "RECORD")
    if parts[0] == "transformers" and len(parts) > 3 and parts[1] == "models":
        return parts[2] in KEEP_TRANSFORMERS_MODELS
    compiled_or_data = COMPILED.search(relpath) or any(relpath.startswith(d + "/") for d in DROP_DIRS)
    return not (source_only and compiled_or_data)


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
    """zb-patch's metadata and entry point, so vLLM loads the repo's zb_patch as a general plugin on the GPU machine."""
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


def build_tree(tree: str, release: str, python: str, site: str | None, wheels: str) -> dict:
    """Assemble the stack's files in ``tree``; returns the manifest's distribution table."""
    pins = lock_versions(release)
    if pins.get("vllm-ascend") != release:
        raise SystemExit(f"gpu_stack: the lock pins vllm-ascend {pins.get('vllm-ascend')}, not {release}")
    os.makedirs(tree)
    dists: dict = {}
    for dist in (*SOURCE_ONLY, *PACKAGES):
        version = pins.get(canonical(dist))
        if version is None and dist in SOURCE_ONLY:
            raise SystemExit(f"gpu_stack: {dist} is not in requirements/{LOCKS[release]}.txt")
        if version is None:
            # the list was found on 0.18.0; a package outside another release's full resolution is not its dependency
            print(f"gpu_stack: {dist} is not in requirements/{LOCKS[release]}.txt: not carried", flush=True)
            dists[dist] = {"version": None, "from": "not in the release's lock", "files": 0, "compiled": []}
            continue
        source_only = dist in SOURCE_ONLY
        if source_only and site:
            files, origin = copy_installed(site, dist, version, tree), site
        else:
            wheel = download(dist, version, python, wheels)
            files, origin = unpack_wheel(wheel, tree, source_only), os.path.basename(wheel)
        compiled = sorted(f for f in files if COMPILED.search(f))
        dists[dist] = {"version": version, "from": origin, "files": len(files), "compiled": compiled}
    return dists


def archive_name(release: str, python: str) -> str:
    return f"stack-{release}-cp{python.replace('.', '')}.tar.xz"


def write_archive(tree: str, path: str) -> None:
    """tar.xz of the tree, entries sorted and owner / time zeroed (the same tree gives the same archive)."""

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(path, "w:xz", preset=6) as tar:
        for root, dirs, files in os.walk(tree):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                tar.add(full, arcname=os.path.relpath(full, tree), filter=normalise)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# Loads every compiled file of the stack in the target interpreter: a Python extension by importing it (an ABI mismatch
# fails here), or, when its package's __init__ needs what only the GPU host has (torch, numpy), through its own loader
# without the package; other shared libraries with ctypes (a missing dependency fails here).
_LOAD_COMPILED = """
import ctypes, importlib, importlib.util, json, os, sys
tree, box_has, failed = sys.argv[1], set(sys.argv[2].split(",")), {}
def needs_box(exc, box_has):
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in box_has:
            return True
        exc = exc.__cause__ or exc.__context__
    return False
for rel in sys.argv[3:]:
    path = os.path.join(tree, rel)
    base = os.path.basename(rel)
    try:
        if ".cpython-" in base or ".abi3." in base:
            name = rel.split(".", 1)[0].replace("/", ".")
            try:
                importlib.import_module(name)
            except ImportError as exc:
                # a box package missing here, also when a package re-raises it as its own ImportError (pandas: "Unable
                # to import required dependency numpy"): load the file alone, or, if its own initialisation imports
                # the GPU machine package, load it as a shared library (its platform and linkage are what can be wrong)
                if not needs_box(exc, box_has):
                    raise
                try:
                    spec = importlib.util.spec_from_file_location(name, path)
                    spec.loader.exec_module(spec.loader.create_module(spec))
                except ImportError as again:
                    if not needs_box(again, box_has):
                        raise
                    ctypes.CDLL(path)
        else:
            ctypes.CDLL(path)
    except Exception as exc:
        failed[rel] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def find_python(version: str) -> str | None:
    """A working ``python<version>`` on PATH, else a pyenv install of it."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = os.path.expanduser("~/.pyenv/versions")
    if os.path.isdir(pyenv):
        candidates += sorted(
            os.path.join(pyenv, v, "bin", f"python{version}") for v in os.listdir(pyenv) if v.startswith(version + ".")
        )
    for exe in candidates:
        if exe and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    return None


def check_compiled(tree: str, python: str, dists: dict) -> dict:
    """Load every compiled file of the stack with ``python<X.Y>`` when this machine has it (the wheels were chosen
    for that interpreter)."""
    exe = find_python(python)
    if exe is None:
        return {"checked": False, "reason": f"no working python{python} here"}
    files = sorted(f for d in dists.values() for f in d["compiled"] if re.search(r"\.so(\.\d+)*$", f))
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONNOUSERSITE": "1"}
    box_modules = ",".join(sorted({"torch", "triton", "numpy", *(d.replace("-", "_") for d in BOX_HAS)}))
    proc = subprocess.run(
        [exe, "-c", _LOAD_COMPILED, tree, box_modules, *files], env=env, capture_output=True, text=True, timeout=600
    )
    failed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"*": proc.stderr[-2000:]}
    return {"checked": True, "python": exe, "files": len(files), "ok": not failed, "failed": failed}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the GPU host's Python major.minor (gpu_probe.sh prints it)")
    ap.add_argument("--release", default="0.18.0", choices=sorted(LOCKS))
    ap.add_argument("--out", default=os.path.join(REPO, ".gpu-stack"), help="the carried folder")
    ap.add_argument("--site", help="site-packages of an installed env of the release (vLLM / vllm-ascend sources)")
    ap.add_argument("--wheels", default=DEFAULT_WHEELS, help="wheel cache")
    ap.add_argument("--tree", help="assemble the unpacked stack here and keep it (default: a temporary folder)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        raise SystemExit(f"gpu_stack: --python {args.python!r}: give major.minor, e.g. 3.12")

    staging = tempfile.mkdtemp(prefix="gpu-stack-")
    tree = args.tree or os.path.join(staging, "tree")
    if args.tree and os.path.exists(tree):
        shutil.rmtree(tree)
    try:
        wheels = os.path.join(args.wheels, "cp" + args.python.replace(".", ""))
        dists = build_tree(tree, args.release, args.python, args.site, wheels)
        zb_version = zb_patch_dist_info(tree)
        compiled_check = check_compiled(tree, args.python, dists)
        os.makedirs(args.out, exist_ok=True)
        name = archive_name(args.release, args.python)
        for old in os.listdir(args.out):
            if old.startswith("stack-") and old.endswith(".tar.xz"):
                os.remove(os.path.join(args.out, old))
        print(f"gpu_stack: compressing {tree_bytes(tree) / MIB:.1f} MiB ...", flush=True)
        write_archive(tree, os.path.join(args.out, name))
        manifest = {
            "release": args.release,
            "python": args.python,
            "archive": name,
            "archive_sha256": sha256(os.path.join(args.out, name)),
            "archive_bytes": os.path.getsize(os.path.join(args.out, name)),
            "tree_bytes": tree_bytes(tree),
            "dists": dists,
            "zb_patch": zb_version,
            "box_has": list(BOX_HAS),
            "stand_ins": list(STAND_INS),
            "compiled_import_check": compiled_check,
        }
        with open(os.path.join(args.out, MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
        biggest = sorted(
            ((tree_bytes(os.path.join(tree, d)), d) for d in os.listdir(tree) if os.path.isdir(os.path.join(tree, d))),
            reverse=True,
        )[:10]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    repo_bytes = working_tree_bytes()
    print(
        f"{args.out}/{name}: {manifest['archive_bytes'] / MIB:.1f} MiB ({manifest['tree_bytes'] / MIB:.1f} MiB "
        f"unpacked, {len(dists)} distributions, python {args.python}, release {args.release}); the working tree "
        f"{repo_bytes / MIB:.1f} MiB; carried together {(manifest['archive_bytes'] + repo_bytes) / MIB:.1f} MiB "
        f"of the 64 MiB limit"
    )
    for size, d in biggest:
        print(f"  {size / MIB:6.1f} MiB  {d}")
    if compiled_check["checked"]:
        status = "ok" if compiled_check["ok"] else "FAILED:\n" + json.dumps(compiled_check["failed"], indent=1)
        print(f"compiled files loaded by {compiled_check['python']}: {compiled_check['files']}, {status}")
    else:
        print(f"compiled modules not import-checked: {compiled_check['reason']}")
    return 0 if compiled_check.get("ok", True) else 1


def working_tree_bytes() -> int:
    """What the device tool copies besides the carried folder: tracked + untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    paths = (os.path.join(REPO, f) for f in out.split("\0") if f)
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


# -- on the GPU host: unpack, check what it has ------------------------------------------------------------------------


def read_manifest(stack_dir: str) -> dict:
    path = os.path.join(stack_dir, MANIFEST)
    if not os.path.isfile(path):
        raise SystemExit(f"gpu_stack: {path} missing: build it with benchmarks/gpu_stack.py and carry {stack_dir}")
    with open(path) as fh:
        return json.load(fh)


def unpack(stack_dir: str, dest_root: str) -> tuple[str, dict]:
    """The unpacked stack for the running Python (unpacked once per archive digest under ``dest_root``). Refuses,
    naming both versions, when the archive was built for another Python."""
    manifest = read_manifest(stack_dir)
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != running:
        raise SystemExit(
            f"gpu_stack: {stack_dir}/{manifest['archive']} was built for Python {manifest['python']}, this is Python "
            f"{running} ({sys.executable}): rebuild with benchmarks/gpu_stack.py --python {running}"
        )
    dest = os.path.join(dest_root, manifest["archive_sha256"][:16])
    if not os.path.isfile(os.path.join(dest, MANIFEST)):
        partial = dest + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(os.path.join(stack_dir, manifest["archive"])) as tar:
            tar.extractall(partial, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(partial)
        shutil.copy(os.path.join(stack_dir, MANIFEST), os.path.join(partial, MANIFEST))
        os.replace(partial, dest)
    return dest, manifest


def box_report(tree: str, manifest: dict) -> dict:
    """What the host provides of BOX_HAS, and every carried distribution's declared requirement on those packages that
    the GPU host's version does not meet (informational: the CPU simulation runs with the same kind of mismatches, e.g.
    vllm-ascend's numpy<2 and torch pins)."""
    sys.path.insert(0, tree)
    from packaging.requirements import Requirement

    have = {}
    for dist in manifest["box_has"]:
        try:
            have[dist] = md.version(dist)
        except md.PackageNotFoundError:
            # importable without metadata (a distro package, a source tree) still counts as there
            have[dist] = "importable, version unknown" if importlib.util.find_spec(dist.replace("-", "_")) else None
    unmet = []
    for name in os.listdir(tree):
        if not name.endswith(".dist-info"):
            continue
        meta = md.PathDistribution(pathlib.Path(tree, name))
        for line in meta.requires or []:
            req = Requirement(line)
            key = canonical(req.name)
            if key not in have or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            version = have[key]
            if version is not None and not version[0].isdigit():
                continue
            if version is None or not req.specifier.contains(version, prereleases=True):
                unmet.append(f"{meta.metadata['Name']} requires {line.split(';')[0].strip()}; the host has {have[key]}")
    return {"box_versions": have, "missing": sorted(k for k, v in have.items() if v is None), "unmet": sorted(unmet)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
