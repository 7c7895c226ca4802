"""`weights = "external"`: the wheel without its weights, and the loader fetching them from a server on
127.0.0.1 (started and stopped by a fixture) into a per-user cache, whatever goes wrong on the way."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import Runtime, build_no_isolation, closed_port, write_project

pytestmark = pytest.mark.integration

MODELS = """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)).eval()
"""


@dataclass
class Server:
    """Files of ``root`` over HTTP, with byte ranges; ``mode`` makes the next answers go wrong."""

    root: Path
    port: int = 0
    mode: str = "ok"
    requests: list[dict[str, str | None]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def url(self, template: str = "{file}") -> str:
        return f"http://127.0.0.1:{self.port}/files/{template}"


def handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Files(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            wanted = self.headers.get("Range")
            server.requests.append({"path": self.path, "range": wanted})
            mode = server.mode
            if mode == "hang":  # accept, then never answer (until the test ends)
                server.release.wait(60)
                return
            path = server.root / self.path.rsplit("/", 1)[-1]
            if mode == "404" or not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            if mode == "corrupt":
                data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
            start = int(wanted.split("=")[1].rstrip("-")) if wanted else 0
            self.send_response(206 if wanted else 200)
            self.send_header("Content-Length", str(len(data) - start))
            if wanted:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            body = data[start:]
            if mode == "cut":  # half of it, then the connection drops
                server.mode = "ok"
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Files


@pytest.fixture(scope="session")
def weights_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("served"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(server))
    httpd.daemon_threads = True
    server.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture()
def served(weights_server: Server) -> Iterator[Server]:
    """The server as each test finds it: answering, with no requests counted yet."""
    weights_server.mode, weights_server.requests[:] = "ok", []
    weights_server.release.clear()
    yield weights_server
    weights_server.release.set()


@pytest.fixture(scope="session")
def external_build(weights_server: Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    hook = f"""
        [tool.hatch.build.targets.wheel.hooks.aoti]
        weights-dir = "uploads"

        [tool.hatch.build.targets.wheel.hooks.aoti.models.mlp]
        factory = "extpkg.models:mlp"
        inputs = [{{ shape = [4, 64] }}]
        weights = "external"
        weights-url = "{weights_server.url()}"
    """
    project = write_project(tmp_path_factory.mktemp("external") / "proj", "extpkg", hook, {"models.py": MODELS})
    proc = build_no_isolation(project, project / "dist")
    (wheel,) = (project / "dist").glob("*.whl")
    for file in (project / "uploads").iterdir():  # "uploaded"
        (weights_server.root / file.name).write_bytes(file.read_bytes())
    site = tmp_path_factory.mktemp("external-site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return project, site, proc.stdout + proc.stderr


def load(runtime: Runtime, site: Path, cache: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh process loading the model and calling it; the last line is its output and ``info()``'s source."""
    code = f"""
        import json, sys; sys.path.insert(0, {str(site)!r})
        import torch
        from extpkg import compiled
        y = compiled.load("mlp")(torch.ones(4, 64))
        print(json.dumps({{"y": y.sum().item(), "source": compiled.info("mlp")["weights_source"]}}))
    """
    return run(runtime, code, cache, check, **env)


def run(runtime: Runtime, code: str, cache: Path, check: bool, **env: str) -> subprocess.CompletedProcess[str]:
    import textwrap

    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE")}
    environ.update({"HATCH_AOTI_WEIGHTS_CACHE": str(cache), "HATCH_AOTI_WEIGHTS_TIMEOUT": "2", **env})
    proc = subprocess.run(
        [str(runtime.python), "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environ, timeout=120
    )
    assert not check or proc.returncode == 0, proc.stderr[-3000:]
    return proc


def expected(project: Path) -> float:
    import torch

    sys.path.insert(0, str(project))
    try:
        from extpkg.models import mlp
    finally:
        sys.path.remove(str(project))
    with torch.no_grad():
        return float(mlp()(torch.ones(4, 64)).sum())


def error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    return proc.stderr.strip().splitlines()[-1]


def test_the_wheel_holds_code_and_manifest_and_the_build_says_what_to_upload(
    external_build: tuple[Path, Path, str], weights_server: Server
) -> None:
    project, site, log = external_build
    (upload,) = (project / "uploads").iterdir()
    manifest = json.loads((site / "extpkg" / "_aoti" / "manifest.json").read_text())
    weights = manifest["models"]["mlp"]["weights"]
    assert upload.name == f"{weights['sha256']}.bin" and weights["external"]["size"] == upload.stat().st_size
    assert weights["external"]["url"] == weights_server.url() and weights["external"]["file"] == upload.name
    assert not list(site.rglob("weights.bin")), "no weights in the wheel"
    assert f"aoti: mlp: weights are external: upload {upload} " in log and weights_server.url(upload.name) in log
    assert not list((project / "dist").glob("uploads")), "nothing beside the wheel in dist/"


def test_first_load_fetches_and_later_loads_ask_nothing(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    project, site, _ = external_build
    first = json.loads(load(runtime, site, tmp_path / "cache").stdout.splitlines()[-1])
    assert abs(first["y"] - expected(project)) < 1e-3 and first["source"]["cached"] is True
    assert len(served.requests) == 1
    again = json.loads(load(runtime, site, tmp_path / "cache").stdout.splitlines()[-1])
    assert again == first and len(served.requests) == 1, "a verified file is trusted: no request, no hashing"


def test_a_cut_download_resumes_where_it_stopped(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    _, site, _ = external_build
    served.mode = "cut"  # the first answer stops half way; the fetch tries again from there
    load(runtime, site, tmp_path / "cache")
    assert len(served.requests) == 2 and served.requests[0]["range"] is None
    assert (served.requests[-1]["range"] or "").startswith("bytes=") and served.requests[-1]["range"] != "bytes=0-"
    assert not list((tmp_path / "cache").glob("*.part"))


def test_corrupted_bytes_are_refused_and_only_their_file_removed(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    _, site, _ = external_build
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "other.bin").write_bytes(b"another model's weights")
    served.mode = "corrupt"
    message = error(load(runtime, site, cache, check=False))
    assert "are not the ones it was built with" in message and "the download was removed" in message, message
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["other.bin"]


@pytest.mark.parametrize("fault", ["404", "down", "hang"])
def test_a_server_that_fails_is_a_clear_error(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path, fault: str
) -> None:
    _, site, _ = external_build
    env = {}
    if fault == "down":
        env["HATCH_AOTI_WEIGHTS_URL_MLP"] = f"{closed_port()}/{{file}}"
    else:
        served.mode = fault
    message = error(load(runtime, site, tmp_path / "cache", check=False, **env))
    assert message.startswith("RuntimeError: compiled model 'mlp': cannot fetch"), message
    if fault == "404":
        assert "HTTP 404" in message and "HATCH_AOTI_WEIGHTS_URL_MLP" in message
    elif fault == "hang":
        assert "no answer within 2 s (HATCH_AOTI_WEIGHTS_TIMEOUT)" in message, message
    else:
        assert "python -m extpkg.compiled fetch mlp" in message, message
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".bin"]


def test_two_processes_loading_at_once_both_succeed(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    project, site, _ = external_build
    results: list[subprocess.CompletedProcess[str]] = []
    threads = [
        threading.Thread(target=lambda: results.append(load(runtime, site, tmp_path / "cache", check=False)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert [p.returncode for p in results] == [0, 0], [p.stderr[-2000:] for p in results]
    assert all(abs(json.loads(p.stdout.splitlines()[-1])["y"] - expected(project)) < 1e-3 for p in results)
    assert len(served.requests) == 1, "the second waited for the first, then trusted its file"


def test_offline_loads_from_the_cache_and_says_how_to_prefetch(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    _, site, _ = external_build
    message = error(load(runtime, site, tmp_path / "cache", check=False, HF_HUB_OFFLINE="1"))
    assert "HF_HUB_OFFLINE is set" in message and "python -m extpkg.compiled fetch mlp" in message, message
    assert served.requests == []
    environ = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    environ.update({"HATCH_AOTI_WEIGHTS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(site)})

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(runtime.python), "-m", "extpkg.compiled", *args],
            capture_output=True,
            text=True,
            env=environ,
            timeout=120,
        )

    assert command().returncode == 2, "no verb: the usage"
    proc = command("fetch")
    assert proc.returncode == 0 and proc.stdout.startswith("mlp: "), proc.stderr
    load(runtime, site, tmp_path / "cache", HF_HUB_OFFLINE="1")
    assert len(served.requests) == 1


def test_a_read_only_cache_serves_what_it_holds_and_says_why_it_cannot_fetch(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    import shutil

    _, site, _ = external_build
    load(runtime, site, tmp_path / "filled")
    mounts = []
    try:
        for name in ("mirror", "empty"):
            tmpfs(tmp_path / name, 8 * 2**20)
            mounts.append(tmp_path / name)
        for file in (tmp_path / "filled").iterdir():
            if not file.name.endswith((".lock", ".part")):
                shutil.copy2(file, tmp_path / "mirror" / file.name)
        for path in mounts:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        requests = len(served.requests)
        load(runtime, site, tmp_path / "mirror")
        assert len(served.requests) == requests
        message = error(load(runtime, site, tmp_path / "empty", check=False))
        assert f"cannot store its weights in {tmp_path / 'empty'}" in message, message
        assert "set HATCH_AOTI_WEIGHTS_CACHE to a writable directory" in message
    finally:
        for path in mounts:
            subprocess.run(["umount", "-l", str(path)], check=False)


def tmpfs(path: Path, size: int) -> None:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_behind(
    external_build: tuple[Path, Path, str], served: Server, runtime: Runtime, tmp_path: Path
) -> None:
    _, site, _ = external_build
    manifest = json.loads((site / "extpkg" / "_aoti" / "manifest.json").read_text())
    size = manifest["models"]["mlp"]["weights"]["external"]["size"]
    assert size >= 64 * 1024, "the test needs a file of several pages"
    small = tmp_path / "small"
    tmpfs(small, size // 2 // 4096 * 4096)
    try:
        message = error(load(runtime, site, small, check=False))
        assert f"cannot store its weights in {small}: not enough disk space or quota (" in message, message
        assert "HATCH_AOTI_WEIGHTS_CACHE" in message
        assert [p.name for p in small.iterdir() if not p.name.endswith(".lock")] == [], "no partial file kept"
        assert served.requests, "it got as far as the download"
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_inspect_and_verify_say_where_the_weights_come_from(
    external_build: tuple[Path, Path, str],
    served: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hatch_aoti.cli import main

    project, _, _ = external_build
    (wheel,) = (project / "dist").glob("*.whl")
    monkeypatch.setenv("HATCH_AOTI_WEIGHTS_CACHE", str(tmp_path / "cache"))
    assert main(["inspect", str(wheel)]) == 0
    assert f"weights from {served.url()}".replace("{file}", "") in capsys.readouterr().out
    assert main(["verify", str(wheel)]) == 0
    text = capsys.readouterr().out
    assert "ok      mlp: ran " in text and ": cached at " in text and str(tmp_path / "cache") in text, text
