"""The loader's fetch of external weights against hostile servers and a hostile cache: servers on
127.0.0.1 only (started and stopped by fixtures, every answer bounded in bytes and time), the loader's
functions called directly."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hatch_aoti.loader import external, fetcher, weights

DATA = bytes(range(256)) * 256  # 64 KiB
SHA = hashlib.sha256(DATA).hexdigest()
FILE = f"{SHA}.bin"


@dataclass
class Server:
    """``DATA`` over HTTP(S) with byte ranges; ``modes`` says how each next answer goes wrong."""

    port: int = 0
    scheme: str = "http"
    modes: list[str] = field(default_factory=list)
    requests: list[dict[str, str | None]] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # bytes of each huge redirect body written
    redirect_to: str = ""

    def url(self, path: str = "files/{file}") -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{path}"


def handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Files(http.server.BaseHTTPRequestHandler):
        timeout = 10  # no answer's socket outlives a test

        def log_message(self, *args: object) -> None:
            pass

        def send(self, body: bytes) -> None:
            try:
                self.wfile.write(body)
            except OSError:
                pass

        def do_GET(self) -> None:
            wanted = self.headers.get("Range")
            server.requests.append(
                {"path": self.path, "range": wanted, "authorization": self.headers.get("Authorization")}
            )
            mode = server.modes.pop(0) if server.modes else "ok"
            start = int(wanted.split("=")[1].rstrip("-")) if wanted else 0
            body = DATA[start:]
            if mode in ("503", "429", "404"):
                self.send_error(int(mode))
            elif mode == "loop":
                server.modes.insert(0, "loop")
                self.send_response(302)
                self.send_header("Location", self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif mode == "redirect":
                self.send_response(302)
                self.send_header("Location", server.redirect_to or self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif mode == "redirect-huge":  # a 302 whose body is 64 MiB: never to be read
                self.send_response(302)
                self.send_header("Location", self.path)
                self.send_header("Content-Length", str(64 << 20))
                self.end_headers()
                total = 0
                for _ in range(64):
                    try:
                        self.wfile.write(bytes(1 << 20))
                    except OSError:
                        break
                    total += 1 << 20
                server.sent.append(total)
            elif mode == "announce-more":
                self.send_response(200)
                self.send_header("Content-Length", str(len(DATA) + 100))
                self.end_headers()
                self.send(DATA + bytes(100))
            elif mode == "no-length-more":  # the right bytes, then 8 times as many, no Content-Length
                self.send_response(200)
                self.end_headers()
                self.send(DATA + bytes(8 * len(DATA)))
                self.close_connection = True
            elif mode == "drip":  # a byte every 50 ms, at most 200 of them
                self.send_response(200)
                self.send_header("Content-Length", str(len(DATA)))
                self.end_headers()
                for i in range(200):
                    try:
                        self.wfile.write(DATA[i : i + 1])
                        self.wfile.flush()
                    except OSError:
                        break
                    time.sleep(0.05)
                self.close_connection = True
            elif mode == "wrong-range":  # a 206 of the whole file, whatever was asked
                self.send_response(206)
                self.send_header("Content-Length", str(len(DATA)))
                self.send_header("Content-Range", f"bytes 0-{len(DATA) - 1}/{len(DATA)}")
                self.end_headers()
                self.send(DATA)
            else:
                self.send_response(206 if wanted else 200)
                self.send_header("Content-Length", str(len(body)))
                if wanted:
                    self.send_header("Content-Range", f"bytes {start}-{len(DATA) - 1}/{len(DATA)}")
                self.end_headers()
                if mode == "cut":  # half of it, then the connection drops
                    self.send(body[: len(body) // 2])
                    self.close_connection = True
                else:
                    self.send(body)

    return Files


def serve(server: Server, context: ssl.SSLContext | None = None) -> Iterator[Server]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(server))
    httpd.daemon_threads = True
    if context is not None:
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    server.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture()
def server() -> Iterator[Server]:
    yield from serve(Server())


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for variable in ("HF_TOKEN", "HF_HUB_OFFLINE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HATCH_AOTI_WEIGHTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HATCH_AOTI_WEIGHTS_TIMEOUT", "1")
    monkeypatch.setattr(fetcher, "_BACKOFF", (0.01, 0.01, 0.01, 0.01))
    return tmp_path / "cache"


def record(url: str) -> dict[str, Any]:
    return {"sha256": SHA, "external": {"url": url, "file": FILE, "size": len(DATA)}}


def failure(url: str) -> str:
    with pytest.raises(RuntimeError) as caught:
        external.fetched("m", record(url))  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("compiled model 'm': ") and url.replace("{file}", FILE) in message, message
    return message


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.exists() else []


def test_a_fetch_creates_a_private_cache_and_stamps_what_it_verified(server: Server, cache: Path) -> None:
    path = external.fetched("m", record(server.url()))  # type: ignore[arg-type]
    assert Path(path).read_bytes() == DATA and oct(cache.stat().st_mode & 0o777) == "0o700"
    assert leftovers(cache) == [FILE, f"{FILE}.verified"] and len(server.requests) == 1


def test_more_bytes_than_the_file_are_never_read(server: Server, cache: Path) -> None:
    server.modes = ["no-length-more"]
    assert Path(external.fetched("m", record(server.url()))).read_bytes() == DATA  # type: ignore[arg-type]
    server.modes, server.requests[:] = ["announce-more"], []
    (cache / FILE).unlink()
    message = failure(server.url())
    assert f"refused: it announces {len(DATA) + 100} bytes where {len(DATA)} are missing" in message
    assert leftovers(cache) == [], "no partial file kept"


def test_a_slow_drip_ends_at_the_whole_fetch_deadline(
    server: Server, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetcher, "_DEADLINE_TIMEOUTS", 2)  # 2 s and a bit, though no read waits 1 s
    server.modes = ["drip"] * 10
    began = time.monotonic()
    message = failure(server.url())
    assert time.monotonic() - began < 2 * fetcher.deadline_seconds(len(DATA)) + 1
    assert "took more than 2 s plus 1 s per MiB (HATCH_AOTI_WEIGHTS_TIMEOUT)" in message, message


def test_a_redirect_body_is_never_read(server: Server, cache: Path) -> None:
    server.modes = ["redirect-huge"]
    assert Path(external.fetched("m", record(server.url()))).read_bytes() == DATA  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while not server.sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.sent[0] < 32 << 20, f"{server.sent[0] >> 20} MiB of the redirect's body were taken"


def test_redirects_are_bounded(server: Server, cache: Path) -> None:
    server.modes = ["loop"]
    message = failure(server.url())
    assert f"refused: more than {fetcher.MAX_REDIRECTS} redirects" in message, message
    assert len(server.requests) == fetcher.MAX_REDIRECTS + 1
    assert leftovers(cache) == []


def test_a_range_that_does_not_start_where_the_partial_file_ends_is_refused(server: Server, cache: Path) -> None:
    cache.mkdir(mode=0o700)
    (cache / f"{FILE}.part").write_bytes(DATA[:1000])
    server.modes = ["wrong-range"]
    message = failure(server.url())
    assert "refused: asked for the bytes from 1000, it sent a range from 0" in message, message
    assert server.requests[0]["range"] == "bytes=1000-"
    assert leftovers(cache) == [], "no partial file that a later fetch would resume from"


@pytest.mark.parametrize("faults", [["503", "cut"], ["429"], ["cut", "cut", "cut"]])
def test_dropped_connections_and_5xx_are_retried_resuming_from_the_partial_file(
    server: Server, cache: Path, faults: list[str]
) -> None:
    server.modes = list(faults)
    assert Path(external.fetched("m", record(server.url()))).read_bytes() == DATA  # type: ignore[arg-type]
    assert len(server.requests) == len(faults) + 1
    if "cut" in faults:
        assert server.requests[-1]["range"] not in (None, "bytes=0-"), server.requests


def test_retries_are_bounded_and_keep_what_came(server: Server, cache: Path) -> None:
    server.modes = ["cut"] * 20
    message = failure(server.url())
    assert "resumes where it stopped" in message and len(server.requests) == len(fetcher._BACKOFF) + 1
    assert leftovers(cache) == [f"{FILE}.part"]


def test_a_4xx_fails_at_once(server: Server, cache: Path) -> None:
    server.modes = ["404"]
    assert "HTTP 404" in failure(server.url()) and len(server.requests) == 1


def test_a_large_fetch_says_what_it_fetches(
    server: Server, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(fetcher, "_ANNOUNCE", 1000)
    external.fetched("m", record(server.url()))  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert f"fetching the weights of 'm' (64.0 KiB) from {server.url().replace('{file}', FILE)}" in err, err


def test_the_token_goes_to_the_hub_over_https_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "secret")
    assert fetcher.token_for("https://huggingface.co/org/repo/resolve/main/x.bin") == "secret"
    assert fetcher.token_for("http://huggingface.co/org/repo/resolve/main/x.bin") is None
    assert fetcher.token_for("https://huggingface.co.example.org/x.bin") is None
    monkeypatch.delenv("HF_TOKEN")
    assert fetcher.token_for("https://huggingface.co/x.bin") is None
    (tmp_path / "token").write_text("saved\n")  # what `hf auth login` writes
    assert fetcher.token_for("https://huggingface.co/x.bin") == "saved"


def certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made for the test."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return directory / "cert.pem", directory / "key.pem"


@pytest.fixture()
def https(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    cert, key = certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    for served in serve(Server(scheme="https"), context):
        yield served, cert


@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"])
def test_https_trusts_the_certificates_the_usual_variables_name(
    https: tuple[Server, Path], cache: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    served, cert = https
    assert "CERTIFICATE_VERIFY_FAILED" in failure(served.url())
    monkeypatch.setenv(variable, str(cert))
    assert Path(external.fetched("m", record(served.url()))).read_bytes() == DATA  # type: ignore[arg-type]


def test_a_redirect_from_https_down_to_http_is_refused_and_gets_no_token(
    https: tuple[Server, Path], server: Server, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served, cert = https
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setattr(fetcher, "_HF_HOSTS", ("127.0.0.1",))
    served.modes, served.redirect_to = ["redirect"], server.url().replace("{file}", FILE)
    message = failure(served.url())
    assert "refused: it redirects from https down to http" in message, message
    assert served.requests[0]["authorization"] == "Bearer secret", "the token went to the https URL"
    assert server.requests == [], "nothing was asked over http"
    monkeypatch.setattr(fetcher, "_HF_HOSTS", ("localhost",))
    assert fetcher.token_for(served.url()) is None


def test_a_planted_symlink_is_never_written_through(server: Server, cache: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's file")
    cache.mkdir(mode=0o700)
    (cache / f"{FILE}.part").symlink_to(victim)
    (cache / f"{FILE}.lock").symlink_to(tmp_path / "elsewhere.lock")
    assert Path(external.fetched("m", record(server.url()))).read_bytes() == DATA  # type: ignore[arg-type]
    assert victim.read_bytes() == b"the victim's file" and not (tmp_path / "elsewhere.lock").exists()


def test_a_cache_that_others_can_write_is_refused_with_the_way_out(server: Server, cache: Path) -> None:
    cache.mkdir()
    cache.chmod(0o777)
    forged = bytes(len(DATA))  # the right size, the wrong bytes, and a stamp that vouches for them
    (cache / FILE).write_bytes(forged)
    st = (cache / FILE).stat()
    (cache / f"{FILE}.verified").write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    with pytest.raises(RuntimeError) as caught:
        external.fetched("m", record(server.url()))  # type: ignore[arg-type]
    message = str(caught.value)
    assert f"the weights cache {cache} cannot be trusted: other users can write to it (mode 777)" in message
    assert f"run `chmod go-w {cache}`" in message and "HATCH_AOTI_WEIGHTS_CACHE" in message, message
    assert server.requests == []


def test_a_file_swapped_after_the_check_is_never_the_one_mapped(
    server: Server, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    real = external._download

    def download_then_swap(*args: Any) -> Any:
        done = real(*args)
        swapped = cache / "swapped"
        swapped.write_bytes(bytes(len(DATA)))
        os.replace(swapped, cache / FILE)
        return done

    monkeypatch.setattr(external, "_download", download_then_swap)
    place = {"offset": 0, "nbytes": 16, "dtype": "uint8", "shape": [16], "stride": [1], "storage_offset": 0}
    entry = {"weights": {**record(server.url()), "tensors": {"w": place}}}
    views = weights.mapped(torch, "m", entry, str(cache), {"c": "w"})  # type: ignore[arg-type]
    assert bytes(views["c"].tolist()) == DATA[:16], "the verified file is the one mapped"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a directory of another user (chown)")
def test_a_cache_of_another_user_is_read_never_written(server: Server, cache: Path) -> None:
    path = Path(external.fetched("m", record(server.url())))  # type: ignore[arg-type]
    for file in (cache, path, Path(f"{path}.verified")):
        os.chown(file, 12345, 12345)
    cache.chmod(0o755)
    before = sorted(p.name for p in cache.iterdir())
    assert external.fetched("m", record(server.url())) == str(path)  # type: ignore[arg-type]
    assert sorted(p.name for p in cache.iterdir()) == before and len(server.requests) == 1
    path.unlink()
    with pytest.raises(RuntimeError) as caught:
        external.fetched("m", record(server.url()))  # type: ignore[arg-type]
    assert "which belongs to another user (uid 12345), who fetches into it: ask them" in str(caught.value)
    assert len(server.requests) == 1, "nothing fetched into another user's cache"
