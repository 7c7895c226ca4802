"""The compile cache's remote tier on a real S3 API (moto's server on loopback) and on a shared
directory (file://), with artifacts made here: no torch, no compiling. Real builds through it
are in test_cache.py."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import S3, closed_port

from hatch_aoti.pipeline.artifacts import file_hashes, sha256
from hatch_aoti.store import remote as remote_mod
from hatch_aoti.store.cache import CompileCache
from hatch_aoti.store.remote import Damaged, Fault, Remote, RemoteCache
from hatch_aoti.store.tiers import Tiers

KEY = "ab" * 32
ENTRY = {
    "backend": "aoti",
    "call": [],
    "cpu": {"arch": "x86_64", "target": "native", "features": []},
    "device": "cpu",
    "file": "m.so",
}


def artifact(root: Path, seed: bytes = b"a") -> Path:
    (root / "data").mkdir(parents=True)
    (root / "m.so").write_bytes(b"\x7fELF" + seed * 2000)
    (root / "m.so").chmod(0o755)
    (root / "data" / "weights.bin").write_bytes(seed * 5000)
    return root


def record(path: Path) -> dict:
    files = file_hashes(path, {})
    entry = {**ENTRY, "files": files, "verification": {"passed": True, "tried": []}}
    return {"entry": entry, "errors": {"max_abs_err": 0.0}, "files": files}


def same_tree(a: Path, b: Path) -> bool:
    """Same files, same bytes, and the same executable bits (wheels keep them)."""

    def modes(root: Path) -> dict[str, bool]:
        return {p.relative_to(root).as_posix(): bool(p.stat().st_mode & 0o100) for p in root.rglob("*") if p.is_file()}

    return file_hashes(a, {}) == file_hashes(b, {}) and modes(a) == modes(b)


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    """An empty remote tier: a bucket on the S3 server, or a shared directory."""
    if request.param == "s3":
        s3: S3 = request.getfixturevalue("s3")
        yield Remote(f"s3://{s3.bucket()}/team/cache", timeout=10)
    else:
        yield Remote((tmp_path / "shared").as_uri(), timeout=10)


def files_of(url: str):  # type: ignore[no-untyped-def]
    """The test's own client of a store (and the path in it): one per store, never the build's."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, use_listings_cache=False) if url.startswith("s3") else url_to_fs(url)
    fs.invalidate_cache()
    return fs, path


def objects(remote: Remote) -> list[str]:
    fs, root = files_of(remote.url)
    return sorted(p[len(root.rstrip("/")) + 1 :] for p in fs.find(root))


def blob_url(remote: Remote, digest: str) -> str:
    return f"{remote.url}/v2/blobs/{digest[:2]}/{digest}"


def overwrite(url: str, data: bytes) -> None:
    fs, path = files_of(url)
    fs.pipe_file(path, data)


def remove(url: str) -> None:
    fs, path = files_of(url)
    fs.rm_file(path)


# -- the protocol ------------------------------------------------------------------------


def test_a_miss_then_an_upload_then_a_hit(store: Remote, tmp_path: Path) -> None:
    client = RemoteCache(store)
    art = artifact(tmp_path / "art")
    assert client.fetch(KEY, "aoti", tmp_path / "out", tmp_path / "scratch") is None
    assert client.upload(KEY, art, record(art)) is True
    names = objects(store)
    assert f"v2/entries/ab/{KEY}.json" in names and len([n for n in names if "/blobs/" in n]) == 2
    assert not [n for n in names if n.endswith(".tmp")], "nothing is left aside"
    got = RemoteCache(store).fetch(KEY, "aoti", tmp_path / "new" / "out", tmp_path / "scratch")
    assert got is not None and got["entry"] == record(art)["entry"] and got["key"] == KEY
    assert same_tree(art, tmp_path / "new" / "out")


def test_uploaders_of_one_key_both_succeed_and_the_first_record_stands(store: Remote, tmp_path: Path) -> None:
    """Two machines compiled the same key to different bytes (compilers need not be deterministic)
    and found no record before uploading: both succeed, and readers get one whole entry, never a mix."""
    arts = [artifact(tmp_path / f"art{i}", seed) for i, seed in enumerate((b"a", b"b"))]
    both_uploaded = threading.Barrier(2, timeout=30)
    outcomes: list[bool] = []

    def upload(art: Path) -> None:
        client = RemoteCache(store)
        create = client._create

        def together(path: str, data: bytes) -> bool:  # both past their check for a record
            both_uploaded.wait()
            return create(path, data)

        client._create = together  # type: ignore[method-assign]
        outcomes.append(client.upload(KEY, art, record(art)))

    threads = [threading.Thread(target=upload, args=(art,)) for art in arts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes) == [False, True]
    got = RemoteCache(store).fetch(KEY, "aoti", tmp_path / "out", tmp_path / "scratch")
    assert got is not None
    assert [same_tree(art, tmp_path / "out") for art in arts].count(True) == 1
    assert got["files"] == file_hashes(tmp_path / "out", {})


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_object_is_never_taken(store: Remote, tmp_path: Path, damage: str) -> None:
    art = artifact(tmp_path / "art")
    RemoteCache(store).upload(KEY, art, record(art))
    digest = sha256(art / "m.so")
    if damage == "delete":
        remove(blob_url(store, digest))
    else:
        overwrite(blob_url(store, digest), b"\x7fELF" + b"z" * 2000 if damage == "corrupt" else b"\x7fELF")
    (tmp_path / "out").mkdir()  # what the build staged before: kept until a whole entry arrives
    with pytest.raises(Damaged, match="m.so"):
        RemoteCache(store).fetch(KEY, "aoti", tmp_path / "out", tmp_path / "scratch")
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "scratch").iterdir()), "nothing half-fetched"


def test_blobs_without_a_record_are_a_miss(tmp_path: Path) -> None:
    store = Remote((tmp_path / "shared").as_uri())
    """An upload cut short before its record: nothing a reader takes."""
    art = artifact(tmp_path / "art")
    client = RemoteCache(store)
    client.upload(KEY, art, record(art))
    remove(f"{store.url}/v2/entries/ab/{KEY}.json")
    assert RemoteCache(store).fetch(KEY, "aoti", tmp_path / "out", tmp_path / "scratch") is None


@pytest.mark.parametrize(
    "change",
    [
        {"key": "cd" * 32},
        {"files": {"../../escape": "0" * 64}},
        {"files": {"/etc/passwd": "0" * 64}},
        {"files": {"m.so": "not a digest"}},
        {"entry": {"call": []}},
        {"sizes": {}},
        {"executable": ["elsewhere.so"]},
    ],
)
def test_a_record_that_is_not_whole_or_reaches_outside_is_refused(tmp_path: Path, change: dict) -> None:
    art = artifact(tmp_path / "art")
    sizes = {rel: (art / rel).stat().st_size for rel in record(art)["files"]}
    good = {**record(art), "key": KEY, "sizes": sizes, "executable": ["m.so"]}
    assert remote_mod.parse_record(json.dumps(good).encode(), KEY, "aoti")["key"] == KEY
    bad = {**good, **change}
    if "files" in change:
        bad["sizes"] = {rel: 1 for rel in change["files"]}
    with pytest.raises(Damaged):
        remote_mod.parse_record(json.dumps(bad).encode(), KEY, "aoti")
    with pytest.raises(Damaged, match="not JSON"):
        remote_mod.parse_record(b"{", KEY, "aoti")


MALFORMED = {
    "no files": lambda r: {"files": {}, "sizes": {}, "executable": []},
    "no verification": lambda r: {"entry": {**r["entry"], "verification": {"passed": False}}},
    "tried is not a list": lambda r: {"entry": {**r["entry"], "verification": {"passed": True, "tried": 5}}},
    "no backend": lambda r: {"entry": {k: v for k, v in r["entry"].items() if k != "backend"}},
    "another backend": lambda r: {"entry": {**r["entry"], "backend": "precompile"}},
    "bad errors": lambda r: {"errors": {"max_abs_err": "big"}},
    "unhashable": lambda r: {"executable": [[1]]},
    "bool size": lambda r: {"sizes": {**r["sizes"], "m.so": True}},
    "file in file": lambda r: naming(r, "a", "a/x"),
    "not normalised": lambda r: naming(r, "a/", "a/x"),
    "outside": lambda r: naming(r, "../x"),
    "code in a number": lambda r: {
        "entry": {
            **r["entry"],
            "call": [
                {
                    "dtype": "float32",
                    "device": "cpu",
                    "shape": [{"name": "n", "min": "__import__('os').getpid() and 0", "max": None}],
                }
            ],
        }
    },
    "weights outside": lambda r: {"entry": {**r["entry"], "weights": {"file": "../../../../.pypirc", "tensors": {}}}},
}


def naming(record: dict, *names: str) -> dict:
    """The record's changes that make it (and its manifest entry) name these files, of its own bytes."""
    files = {name: next(iter(record["files"].values())) for name in names}
    entry = {**record["entry"], "files": files}
    return {"files": files, "sizes": dict.fromkeys(files, 1), "executable": [], "entry": entry}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_record_is_damage_never_a_failed_build(tmp_path: Path, change) -> None:
    """What is checked does not depend on the store: a shared directory stands for them all."""
    remote = Remote((tmp_path / "shared").as_uri(), timeout=5)
    art = artifact(tmp_path / "art")
    RemoteCache(remote).upload(KEY, art, record(art))
    url = f"{remote.url}/v2/entries/ab/{KEY}.json"
    fs, path = files_of(url)
    good = json.loads(fs.cat_file(path))
    overwrite(url, json.dumps({**good, **change(good)}).encode())
    cache, notices = tiers(Remote(remote.url, "read-only", 5), None, tmp_path / "scratch")
    (tmp_path / "out").mkdir()
    assert cache.lookup("m", KEY, "aoti", tmp_path / "out") is None
    assert len(notices) == 1 and "damaged: its record" in notices[0] and not cache.down
    assert not list((tmp_path / "out").iterdir()), "nothing of it was staged"


# -- the two tiers together ---------------------------------------------------------------


def tiers(remote: Remote | None, local: Path | None, scratch: Path) -> tuple[Tiers, list[str]]:
    notices: list[str] = []
    store = CompileCache(local) if local is not None else None
    return Tiers(store, RemoteCache(remote) if remote else None, notices.append, scratch), notices


def test_a_remote_hit_is_kept_locally_and_a_compiled_model_goes_to_both(store: Remote, tmp_path: Path) -> None:
    art = artifact(tmp_path / "art")
    first, notices = tiers(store, tmp_path / "local1", tmp_path / "scratch")
    assert first.lookup("m", KEY, "aoti", tmp_path / "out0") is None
    first.store("m", KEY, art, {"entry": record(art)["entry"], "errors": None})
    assert len(CompileCache(tmp_path / "local1").entries()) == 1 and f"v2/entries/ab/{KEY}.json" in objects(store)

    second, notices = tiers(store, tmp_path / "local2", tmp_path / "scratch")
    found = second.lookup("m", KEY, "aoti", tmp_path / "out")
    assert found is not None and found[1] == "remote" and same_tree(art, tmp_path / "out")
    assert found[0]["entry"] == record(art)["entry"] and not notices
    nowhere = Remote((tmp_path / "empty").as_uri(), timeout=1)
    again = tiers(nowhere, tmp_path / "local2", tmp_path / "scratch")[0].lookup("m", KEY, "aoti", tmp_path / "out2")
    assert again is not None and again[1] == "local", "the remote hit was kept in the local cache"


def test_read_only_reads_and_never_writes(store: Remote, tmp_path: Path) -> None:
    art = artifact(tmp_path / "art")
    read_only = Remote(store.url, "read-only", store.timeout)
    cache, notices = tiers(read_only, tmp_path / "local", tmp_path / "scratch")
    cache.store("m", KEY, art, {"entry": record(art)["entry"], "errors": None})
    assert objects(store) == [] and not notices
    RemoteCache(store).upload(KEY, art, record(art))
    overwrite(blob_url(store, sha256(art / "m.so")), b"bad")
    cache, notices = tiers(read_only, tmp_path / "local2", tmp_path / "scratch")
    assert cache.lookup("m", KEY, "aoti", tmp_path / "out") is None and not (tmp_path / "out").exists()
    assert len(notices) == 1 and "damaged" in notices[0] and "compiling it here" in notices[0]
    assert f"v2/entries/ab/{KEY}.json" in objects(store), "read-only never removes"


@pytest.mark.parametrize("damage", [b"bad", b"\x7fELF" + b"z" * 2000], ids=["shorter", "same size"])
def test_a_damaged_entry_is_replaced_by_the_next_upload_in_read_write(
    store: Remote, tmp_path: Path, damage: bytes
) -> None:
    art = artifact(tmp_path / "art")
    RemoteCache(store).upload(KEY, art, record(art))
    overwrite(blob_url(store, sha256(art / "m.so")), damage)
    cache, notices = tiers(store, None, tmp_path / "scratch")
    assert cache.lookup("m", KEY, "aoti", tmp_path / "out") is None and len(notices) == 1
    cache.store("m", KEY, art, {"entry": record(art)["entry"], "errors": None})
    found = tiers(store, None, tmp_path / "scratch")[0].lookup("m", KEY, "aoti", tmp_path / "out")
    assert found is not None and same_tree(art, tmp_path / "out"), "the recompiled model replaced it"


# -- faults ---------------------------------------------------------------------------------


@pytest.fixture()
def silent_server() -> Iterator[str]:
    """A TCP server on loopback that accepts connections and never answers."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    sock.close()


@pytest.mark.parametrize("server", ["down", "silent"])
def test_a_store_that_is_down_or_silent_is_reported_once_and_not_asked_again(
    s3: S3, server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    endpoint = closed_port() if server == "down" else request.getfixturevalue("silent_server")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    art = artifact(tmp_path / "art")
    cache, notices = tiers(Remote("s3://cache-bucket/x", timeout=1), tmp_path / "local", tmp_path / "scratch")
    assert cache.lookup("m", KEY, "aoti", tmp_path / "out") is None
    assert len(notices) == 1 and "s3://cache-bucket/x failed" in notices[0]
    if server == "silent":
        assert "no answer within" in notices[0]
    assert cache.lookup("n", "cd" * 32, "aoti", tmp_path / "out2") is None
    cache.store("m", KEY, art, {"entry": record(art)["entry"], "errors": None})
    assert len(notices) == 1, "said once"
    assert len(CompileCache(tmp_path / "local").entries()) == 1, "the local tier still works"


def test_an_upload_cut_short_leaves_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Remote((tmp_path / "shared").as_uri())
    """The store goes away after the first file: the record, written last, is not there."""
    art = artifact(tmp_path / "art")
    client = RemoteCache(store)
    real, sent = client._put_blob, []

    def put_blob(path: Path, digest: str, size: int) -> None:
        if sent:
            raise Fault("the store went away")
        sent.append(real(path, digest, size))

    monkeypatch.setattr(client, "_put_blob", put_blob)
    cache = Tiers(None, client, (notices := []).append, tmp_path / "scratch")
    cache.store("m", KEY, art, {"entry": record(art)["entry"], "errors": None})
    assert len(notices) == 1 and "went away" in notices[0] and sent
    assert [n for n in objects(store) if "/blobs/" in n] and not [n for n in objects(store) if "/entries/" in n]
    assert RemoteCache(store).fetch(KEY, "aoti", tmp_path / "out", tmp_path / "scratch") is None


def test_a_race_the_store_reports_as_another_error_is_lost_not_a_fault(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 can answer a conditional write that races a delete with 409: the record there stands."""
    remote = Remote(f"s3://{s3.bucket()}/c", timeout=5)
    art = artifact(tmp_path / "art")
    assert RemoteCache(remote).upload(KEY, art, record(art))
    late = RemoteCache(remote)
    fs, asked = late._connect()[0], []

    def exists(path: str) -> bool:  # not there when first asked (the race), there afterwards
        asked.append(path)
        return len(asked) > 1

    def conflict(path: str, data: bytes, mode: str) -> None:
        raise OSError("ConditionalRequestConflict")

    monkeypatch.setattr(fs, "exists", exists)
    monkeypatch.setattr(fs, "pipe_file", conflict)
    assert late.upload(KEY, art, record(art)) is False and len(asked) == 2


# -- settings ------------------------------------------------------------------------------


def test_the_environment_names_the_store_and_its_mode() -> None:
    url, mode, timeout = "HATCH_AOTI_REMOTE_CACHE", "HATCH_AOTI_REMOTE_CACHE_MODE", "HATCH_AOTI_REMOTE_CACHE_TIMEOUT"
    assert remote_mod.from_env({}) is None
    got = remote_mod.from_env({url: "file:///mnt/cache", mode: "READ-ONLY"})
    assert got == Remote("file:///mnt/cache", "read-only", remote_mod.DEFAULT_TIMEOUT) and not got.writable
    assert remote_mod.from_env({url: "s3://b/p", timeout: "5"}) == Remote("s3://b/p", "read-write", 5.0)
    with pytest.raises(ValueError, match="HATCH_AOTI_REMOTE_CACHE_MODE must be read-write or read-only, not 'rw'"):
        remote_mod.from_env({"HATCH_AOTI_REMOTE_CACHE": "s3://b/p", "HATCH_AOTI_REMOTE_CACHE_MODE": "rw"})
    with pytest.raises(ValueError, match="HATCH_AOTI_REMOTE_CACHE_TIMEOUT must be a number of seconds"):
        remote_mod.from_env({"HATCH_AOTI_REMOTE_CACHE": "s3://b/p", "HATCH_AOTI_REMOTE_CACHE_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="fsspec knows no protocol 'nosuch'"):
        remote_mod.from_env({"HATCH_AOTI_REMOTE_CACHE": "nosuch://b/p"})


@pytest.mark.parametrize(("url", "extra"), [("s3://b/p", "s3"), ("gs://b/p", "gcs")])
def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, url: str, extra: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in ("s3fs", "gcsfs") else real(name))
    with pytest.raises(ValueError, match=rf"install hatch-aoti\[{extra}\] where the build runs"):
        remote_mod.from_env({"HATCH_AOTI_REMOTE_CACHE": url})


def test_a_bad_setting_fails_the_build_with_its_message_and_no_cache_means_no_remote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hatch_aoti.pipeline.core import BuildFailed, remote_cache

    monkeypatch.setenv("HATCH_AOTI_REMOTE_CACHE", "s3://b/p")
    monkeypatch.setenv("HATCH_AOTI_REMOTE_CACHE_MODE", "sometimes")
    with pytest.raises(BuildFailed, match="HATCH_AOTI_REMOTE_CACHE_MODE"):
        remote_cache()
    monkeypatch.setenv("HATCH_AOTI_NO_CACHE", "1")
    assert remote_cache() is None


def test_cache_info_shows_the_remote_tier(store: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hatch_aoti.cli import main

    art = artifact(tmp_path / "art")
    RemoteCache(store).upload(KEY, art, record(art))
    monkeypatch.setenv("HATCH_AOTI_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("HATCH_AOTI_REMOTE_CACHE", store.url)
    out = tmp_path / "info.json"
    with open(out, "w") as f:
        monkeypatch.setattr("sys.stdout", f)
        assert main(["cache", "info", "--json"]) == 0
    data = json.loads(out.read_text())["remote"]
    size = sum(os.path.getsize(p) for p in art.rglob("*") if p.is_file())
    assert data == {"url": store.url, "mode": "read-write", "timeout_s": 30.0, "entries": 1, "size": size}


def test_a_transfer_that_timed_out_stops_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread a timed-out download is left in writes nothing more once the build has given up on it."""
    import time

    store = Remote((tmp_path / "shared").as_uri(), timeout=1)
    art = artifact(tmp_path / "art")
    RemoteCache(store).upload(KEY, art, record(art))
    client = RemoteCache(store)
    fs = client._connect()[0]
    real_open = fs.open

    class Drip:
        def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
            self.f = f

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
            self.f.close()

        def read(self, n: int = -1) -> bytes:
            time.sleep(0.3)  # a byte at a time, slowly: past the deadline
            return b"x"

    def dripping(path: str, mode: str = "rb", **kw):  # type: ignore[no-untyped-def]
        return Drip(real_open(path, mode)) if "/blobs/" in path else real_open(path, mode, **kw)

    monkeypatch.setattr(fs, "open", dripping)
    monkeypatch.setattr(remote_mod, "SECONDS_PER_BYTE", 0)
    with pytest.raises(Fault, match="no answer within"):
        client.fetch(KEY, "aoti", tmp_path / "out", tmp_path / "scratch")
    time.sleep(1.0)  # the abandoned thread sees the stop within a read
    left = [p for p in (tmp_path / "scratch").rglob("*") if p.is_file()]
    sizes = [p.stat().st_size for p in left]
    time.sleep(1.0)
    assert not left or sizes == [p.stat().st_size for p in left if p.exists()], "it went on writing"
    assert not [p for p in (tmp_path / "scratch").rglob("*") if p.is_file()], "what it wrote is removed"
