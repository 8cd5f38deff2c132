"""``shoal up``: one command gives a working endpoint; Ctrl-C leaves nothing behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import http_calls
from cluster import (
    CLUSTER_TAG,
    MODEL,
    Proc,
    clean_env,
    free_port,
    keys_cli,
    llama_server_pids,
    wait_until,
)

pytestmark = pytest.mark.e2e

README = Path(__file__).parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"
"""Where the README's quick start says ``shoal up`` listens (its default port)."""
KEY = re.compile(r"\b(sk|ak)-shoal-[A-Za-z0-9_-]{43}\b")


def start_up(
    tmp_path: Path,
    llama_server: Path,
    model_path: Path,
    *flags: str,
    database: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[Proc, int]:
    """``shoal up`` as a user runs it, waited on until it prints its banner; ``env``: more
    variables in its environment."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "shoal",
        "up",
        "--port",
        str(port),
        *flags,
        "--llama-server-path",
        str(llama_server),
        "--model",
        str(model_path),
        "--model-alias",
        MODEL,
        "--slots",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    database = database or tmp_path
    variables = {CLUSTER_TAG: str(tmp_path), "SHOAL_DATABASE_URL": f"sqlite:///{database}/shoal.db"}
    proc = Proc("up", argv, tmp_path / "up.log", clean_env(**variables, **(env or {}))).start()
    wait_until(lambda: "Shoal is up." in proc.log() or not proc.alive(), 90, "the banner")
    assert proc.alive(), proc.log()[-3000:]
    return proc, port


def test_up_serves_and_stops_cleanly(tmp_path: Path, llama_server: Path, model_path: Path) -> None:
    proc, port = start_up(tmp_path, llama_server, model_path)
    try:
        log = proc.log()
        assert f"http://127.0.0.1:{port}/v1" in log and f"http://127.0.0.1:{port}/" in log
        # The first run creates an inference and an admin key and shows them, once.
        key = re.search(r"API key: +(sk-shoal-\S+)", log)
        admin = re.search(r"Admin key: +(ak-shoal-\S+)", log)
        assert key is not None and admin is not None, log[-2000:]
        curl = re.search(r"curl -N (\S+)", log)
        assert curl is not None and f"export OPENAI_API_KEY={key.group(1)}\n" in log
        assert f"export OPENAI_BASE_URL=http://127.0.0.1:{port}/v1\n" in log
        assert 'Bearer $OPENAI_API_KEY"' in log
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert http_calls.post(curl.group(1), json=body).status_code == 401
        auth = {"Authorization": f"Bearer {key.group(1)}"}
        r = http_calls.post(curl.group(1), json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL
        base = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=base, api_key=key.group(1)) as client:
            assert [m.id for m in client.models.list()] == [MODEL]
        assert llama_server_pids(str(tmp_path))
        joined = add_worker_as_the_banner_says(tmp_path, log, llama_server, model_path)
        try:
            admin_auth = {"Authorization": f"Bearer {admin.group(1)}"}

            def names() -> set[str]:
                r = http_calls.get(f"http://127.0.0.1:{port}/api/v1/workers", headers=admin_auth)
                return {w["name"] for w in r.json()["data"]}

            wait_until(lambda: names() == {"local", "second"}, 60, "the second worker")
        finally:
            assert joined.stop() == 0, joined.log()[-3000:]
    finally:
        proc.signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 0, proc.log()[-3000:]
    assert not llama_server_pids(str(tmp_path)), "llama-server left behind after Ctrl-C"

    # A second run keeps the keys and does not show them again.
    again, _ = start_up(tmp_path / "again", llama_server, model_path, database=tmp_path)
    try:
        assert key.group(1) not in again.log() and admin.group(1) not in again.log()
        assert "the inference key the first run printed" in again.log()
        assert "shoal keys create --scope inference" in again.log()
        assert "export OPENAI_API_KEY" not in again.log()  # nothing to export: it has no key
        assert "Try it, with that key in OPENAI_API_KEY:" in again.log()
    finally:
        again.signal(signal.SIGINT)
        assert again.wait(30) == 0


def add_worker_as_the_banner_says(
    tmp_path: Path, log: str, llama_server: Path, model_path: Path
) -> Proc:
    """The banner's "Add a worker" lines, followed: a worker key from `shoal keys create`, then
    its `shoal worker` command (with the test's model, so that it loads quickly)."""
    create = re.search(r"`(shoal keys create --scope worker --name) NAME`", log)
    join = re.search(r"^  (shoal worker --router-url \S+ --gpu-key) WORKER_KEY$", log, re.M)
    assert create is not None and join is not None, log[-2000:]
    database = f"sqlite:///{tmp_path}/shoal.db"
    created = keys_cli(database, *create.group(1).split()[2:], "second")
    worker_key = created.splitlines()[-1]
    argv = [sys.executable, "-m", *join.group(1).split(), worker_key, "--name", "second"]
    argv += ["--model", str(model_path), "--model-alias", MODEL, "--threads", "1"]
    argv += ["--llama-server-path", str(llama_server), "--cache-dir", str(tmp_path / "cache")]
    env = clean_env(**{CLUSTER_TAG: str(tmp_path)})
    return Proc("worker", argv, tmp_path / "second-worker.log", env).start()


def test_up_beyond_loopback_generates_a_key(
    tmp_path: Path, llama_server: Path, model_path: Path
) -> None:
    """Beyond loopback only its keys open it: not a key a client exported in the shell that
    started it (SHOAL_API_KEY was read as --api-key before; it is ignored, with a warning)."""
    exported = {"SHOAL_API_KEY": "sk-client-export", "OPENAI_API_KEY": "sk-client-export"}
    proc, port = start_up(tmp_path, llama_server, model_path, "--host", "0.0.0.0", env=exported)
    try:
        key = re.search(r"API key: +(sk-shoal-\S+)", proc.log())
        assert key is not None
        url = f"http://127.0.0.1:{port}/v1/models"
        assert http_calls.get(url).status_code == 401
        assert http_calls.get(url, headers={"Authorization": f"Bearer {key.group(1)}"}).is_success
        assert proc.log().count(key.group(1)) == 2  # the banner's key line and its export only
        exported_key = {"Authorization": "Bearer sk-client-export"}
        assert http_calls.get(url, headers=exported_key).status_code == 401
        assert proc.log().count("SHOAL_API_KEY is set here and ignored") == 1
        assert "sk-client-export" not in proc.log()
    finally:
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _has_loaded(pid: int, library: str) -> bool:
    """Whether process ``pid`` has mapped a shared library whose path contains ``library``."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("moment", ["importing", "starting"])
def test_ctrl_c_while_shoal_up_starts_exits_without_a_traceback(
    tmp_path: Path, llama_server: Path, model_path: Path, moment: str
) -> None:
    """Ctrl-C in the first second: while Python imports the command (pydantic's compiled core
    is mapped then: the command's imports have begun; before, a traceback of whichever import
    it cut), or while the router and worker start. It exits at once, leaves nothing behind."""
    argv = [sys.executable, "-m", "shoal", "up", "--port", str(free_port())]
    argv += ["--llama-server-path", str(llama_server), "--model", str(model_path)]
    argv += ["--slots", "1", "--cache-dir", str(tmp_path / "cache")]
    variables = {CLUSTER_TAG: str(tmp_path), "SHOAL_DATABASE_URL": f"sqlite:///{tmp_path}/s.db"}
    proc = Proc("up", argv, tmp_path / "up.log", clean_env(**variables), ctrl_c=True).start()
    try:
        if moment == "importing":
            wait_until(lambda: _has_loaded(proc.pid, "pydantic_core"), 60, "the imports", 0.001)
        else:
            wait_until(lambda: "shoal.keys" in proc.log(), 90, "the start", 0.01)
        proc.signal(signal.SIGINT)
        code = proc.wait(60)
    finally:
        proc.stop()  # still running only when the test failed: leave nothing behind
    log = proc.log()
    assert "Traceback" not in log, log[-3000:]
    assert code == (130 if moment == "importing" else 0), log[-3000:]
    wait_until(lambda: not llama_server_pids(str(tmp_path)), 10, "llama-server to go")


def readme_block(section: str, lang: str = "") -> str:
    """The first fenced block in ``lang`` of the README's ``section`` (a ``## `` heading)."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    found = re.search(rf"^```{lang}\n(.*?)^```$", text[start:end], re.MULTILINE | re.DOTALL)
    assert found is not None, f"no ```{lang} block under '## {section}' in README.md"
    return found.group(1)


def banner_of(log: str, port: int) -> str:
    """The banner in ``log``, as the README would show it: default port, keys elided."""
    start = log.index("Shoal is up.\n")
    end = log.index("Press Ctrl-C to stop everything.\n", start)
    text = log[start : end + len("Press Ctrl-C to stop everything.\n")]
    return KEY.sub(
        r"\1-shoal-KEY", text.replace(f"127.0.0.1:{port}", README_URL.removeprefix("http://"))
    )


def test_readme_quick_start_runs_as_written(
    tmp_path: Path, llama_server: Path, model_path: Path
) -> None:
    """The README's first screen: what ``shoal up`` prints, its curl, and the Python example
    pasted into the shell where the banner's two exports ran (read from the README itself,
    so the test fails when the README and ``shoal up`` drift apart)."""
    proc, port = start_up(tmp_path, llama_server, model_path)
    try:
        log = proc.log()
        readme_banner = KEY.sub(r"\1-shoal-KEY", readme_block("What you get"))
        assert banner_of(log, port) == readme_banner
        exports = dict(re.findall(r"^  export (OPENAI_\w+)=(\S+)$", log, re.MULTILINE))
        assert exports.keys() == {"OPENAI_BASE_URL", "OPENAI_API_KEY"}, log[-2000:]
        env = clean_env(**exports)

        # The banner's "Try it" lines, pasted into a shell as they are.
        try_it = log[log.index("Try it:\n") + len("Try it:\n") : log.index("Add a worker")]
        # A bounded answer: a small model may otherwise go on to the end of its context.
        assert '"max_tokens": 64' in try_it, try_it
        shell = subprocess.run(
            ["bash", "-c", try_it], env=clean_env(), capture_output=True, text=True, timeout=120
        )
        assert shell.returncode == 0, shell.stderr[-2000:]
        assert shell.stdout.rstrip().endswith("data: [DONE]"), shell.stdout[-2000:]
        assert '"delta"' in shell.stdout, shell.stdout[-2000:]

        # The README's Python example, with the official openai client (which reads the
        # base URL and the key from those variables on its own).
        example = readme_block("What you get", "python")
        assert "OpenAI()" in example and README_URL not in example, example
        assert "max_tokens=64" in example, example
        run = subprocess.run(
            [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip() and run.stdout.endswith("\n"), run.stdout
    finally:
        proc.signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.log()[-3000:]
