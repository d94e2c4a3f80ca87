import importlib.metadata as md

import pytest

from zb_patch.detect import PackageInfo, Versions, _Headers, detect, package, parse


@pytest.mark.parametrize(
    "raw, release, pre, post, dev, local, commit, final",
    [
        ("0.18.0", (0, 18, 0), None, None, None, None, None, True),
        ("0.18.1.dev45+g35141a7", (0, 18, 1), None, None, 45, "g35141a7", "35141a7", False),
        ("0.25.1+empty", (0, 25, 1), None, None, None, "empty", None, False),
        ("0.13.0rc2", (0, 13, 0), ("rc", 2), None, None, None, None, False),
        ("0.23.0.post1", (0, 23, 0), None, 1, None, None, None, True),
        ("2.13.0+cpu", (2, 13, 0), None, None, None, "cpu", None, False),
        ("0.11.0+g1a2b3c4.d20260101", (0, 11, 0), None, None, None, "g1a2b3c4.d20260101", "1a2b3c4", False),
        ("0.9.1+20260101", (0, 9, 1), None, None, None, "20260101", None, False),
        ("0.19.1rc1.dev3+gdeadbeefcafe", (0, 19, 1), ("rc", 1), None, 3, "gdeadbeefcafe", "deadbeefcafe", False),
    ],
)
def test_parse_forms(raw, release, pre, post, dev, local, commit, final):
    info = parse("vllm", raw, "vllm")
    assert info.installed and info.error is None
    assert info.release == release
    assert info.pre == pre
    assert info.post == post
    assert info.dev == dev
    assert info.local == local
    assert info.commit == commit
    assert info.is_final is final
    assert info.base == ".".join(map(str, release))


def test_dev_build_belongs_to_its_release_family():
    info = parse("vllm_ascend", "0.18.1.dev45+g35141a7")
    assert info.release_in((0, 18), (0, 19))
    assert not info.release_in((0, 19), (0, 24))
    assert info.release_at_least(0, 18, 1)
    assert not info.release_at_least(0, 18, 2)


def test_unparsable_version_is_reported_not_raised():
    info = parse("vllm", "not-a-version")
    assert info.installed
    assert info.error
    assert info.version is None
    assert "unparsable" in info.describe()


def test_missing_package_is_a_normal_answer():
    info = package("zb-patch-this-package-does-not-exist")
    assert info == PackageInfo(name="zb-patch-this-package-does-not-exist")
    assert not info.installed
    assert info.base is None
    assert not info.release_at_least(0)
    assert info.describe() == "not installed"


def test_installed_package_from_metadata():
    info = package("packaging")
    assert info.installed and info.dist == "packaging"
    assert info.release and info.release[0] >= 21


def test_detect_covers_all_packages_and_serialises():
    v = detect()
    assert isinstance(v, Versions)
    d = v.as_dict()
    assert set(d) == {"vllm", "vllm_ascend", "torch", "torch_npu", "triton", "triton_ascend"}
    for entry in d.values():
        assert set(entry) >= {"installed", "version", "release", "commit"}
    assert "vllm=" in v.summary()


def test_version_from_the_header_block_is_importlib_metadatas():
    """detect() reads a version from the metadata's header block only: the same answer as importlib.metadata for every
    installed distribution and for metadata whose body, first line or line ends could mislead a shortcut."""
    installed = list(md.distributions())
    assert installed
    for dist in installed:
        assert _Headers(dist).version == dist.version, dist.metadata["Name"]


@pytest.mark.parametrize(
    "files",
    [
        {"METADATA": "Metadata-Version: 2.1\nName: x\nVersion: 1.2.3\n\nVersion: 9.9.9\n\nbody\n"},
        {"METADATA": "Metadata-Version: 2.1\nName: x\n\nVersion: 9.9.9\n"},  # none in the headers
        {"METADATA": "\nVersion: 9.9.9\n"},  # an empty first line: no headers at all
        {"METADATA": "Name: x\r\nVersion: 1.2.3 \r\n\r\nVersion: 9.9.9\r\n"},  # CRLF, a trailing blank
        {"METADATA": "Name: x\nVersion:\n  1.2.3\n\n"},  # a folded header
        {"METADATA": "", "PKG-INFO": "Name: x\nVersion: 2.0\n\nVersion: 9.9.9\n"},  # an empty METADATA
        {"PKG-INFO": "Name: x\nVersion: 2.0\n"},
    ],
)
def test_version_from_the_header_block_of_odd_metadata(tmp_path, files):
    info = tmp_path / "x-1.dist-info"
    info.mkdir()
    for name, text in files.items():
        (info / name).write_bytes(text.encode())
    dist = md.PathDistribution(info)
    assert _Headers(dist).version == dist.version
