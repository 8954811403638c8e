"""docs/ray.md's walk-throughs, run as written: `serve run serve.yaml` (a local cluster, the
bundled model served as aieng-kjv-6m on the config's HTTP port, stopped with Ctrl-C), and a
cluster of one's own with token authentication (`ray get-auth-token --generate`,
`RAY_AUTH_MODE=token`, `ray start --head`, `serve start --http-port`, `serve run --address`).

Ports are chosen free in place of the documented ones; `ray start` gets `--block` and is ended
by its process id in place of `ray stop` (which would stop every Ray process of the machine,
other tests' included), and `serve shutdown` (which goes through the dashboard, not started
here) is left to it. HOME is a fresh folder, so the token is this test's own."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import free_port, wait_ready

DOC = Path(__file__).resolve().parents[1] / "docs" / "ray.md"
PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
BIN = Path(sys.executable).parent
SECTION = "## From `pip install` to a served request"


def walkthroughs() -> list[str]:
    """The bash blocks of the section, in order."""
    text = DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    """The block's commands, comments dropped, continuation lines joined, a heredoc whole."""
    out: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if "<<'" in line:
            end = line.split("<<'")[1].split("'")[0]
            body = [line]
            for more in lines:
                body.append(more)
                if more == end:
                    break
            out.append("\n".join(body))
            continue
        while line.endswith("\\"):
            line = line[:-1] + next(lines).strip()
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command:
            out.append(command)
    return out


@pytest.fixture
def shell_env(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # socket paths: 107 bytes at most
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(PYTHON_DIR), os.environ.get("PYTHONPATH")) if p
        ),
        "RAY_TMPDIR": ray_dir,  # this cluster's files, apart from any other's
        "OMP_NUM_THREADS": "1",
    }
    (tmp_path / "home").mkdir()
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)
    yield env
    shutil.rmtree(ray_dir, ignore_errors=True)


def run(command: str, env: dict, cwd: Path, timeout: float = 180) -> str:
    done = subprocess.run(
        ["bash", "-c", command], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout


def wait_for_model(url: str, proc: subprocess.Popen) -> None:
    """Until the application is ready; it serves the bundled model under its own name."""
    wait_ready(url, timeout=240, proc=proc)
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["aieng-kjv-6m"], models


def completion(command: str, env: dict, cwd: Path) -> dict:
    answer = json.loads(run(command, env, cwd, timeout=60))
    assert answer.get("model") == "aieng-kjv-6m" and answer["choices"][0]["text"], answer
    return answer


def stop(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def test_serve_run_with_a_config_serves_the_bundled_model_on_its_port(tmp_path, shell_env):
    block = walkthroughs()[0]
    port = str(free_port())
    steps = [c.replace("8100", port) for c in commands(block) if not c.startswith("pip ")]
    write, serve_run, curl = steps
    run(write, shell_env, tmp_path)
    assert serve_run == "serve run serve.yaml"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {serve_run}"], env=shell_env, cwd=tmp_path, stdout=log, stderr=log
    )
    try:
        wait_for_model(f"http://127.0.0.1:{port}", proc)
        completion(curl, shell_env, tmp_path)
    finally:
        stop(proc, signal.SIGINT)  # Ctrl-C: the application and the local cluster stop
        log.close()
    assert proc.returncode is not None


def test_a_cluster_with_token_authentication_serves_on_the_chosen_port(tmp_path, shell_env):
    steps = commands(walkthroughs()[1])
    assert steps[0] == "ray get-auth-token --generate"
    assert steps[1] == "export RAY_AUTH_MODE=token"
    run(steps[0], shell_env, tmp_path)
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()
    env = {**shell_env, "RAY_AUTH_MODE": "token"}
    gcs, http = str(free_port()), str(free_port())
    spare = ["--ray-client-server-port", "--dashboard-agent-listen-port"]
    spare += ["--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
    extra = " ".join(f"{flag} {free_port()}" for flag in spare)
    head = steps[2].replace("6379", gcs) + f" --block --include-dashboard false {extra}"
    log = (tmp_path / "ray.log").open("w")
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {head}"], env=env, cwd=tmp_path, stdout=log, stderr=log
    )
    try:
        serve_start, serve_run, models = steps[3], steps[4], steps[5]
        for command in (serve_start, serve_run):
            command = command.replace("6379", gcs).replace("8100", http)
            for _ in range(60):  # until the head answers
                done = subprocess.run(
                    ["bash", "-c", command], env=env, cwd=tmp_path, capture_output=True, text=True
                )
                if done.returncode == 0 or "Authentication" in done.stderr:
                    break
                time.sleep(2)
            assert done.returncode == 0, (command, done.stderr[-4000:])
        # without RAY_AUTH_MODE a command that connects by address is refused
        refused = subprocess.run(
            ["bash", "-c", steps[3].replace("6379", gcs).replace("8100", http)],
            env=shell_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower()
        wait_for_model(f"http://127.0.0.1:{http}", proc)
        assert models.startswith("curl ")
        listed = json.loads(run(models.replace("8100", http), env, tmp_path, timeout=60))
        assert [m["id"] for m in listed["data"]] == ["aieng-kjv-6m"]
        assert steps[6:] == ["serve shutdown -y", "ray stop"]
    finally:
        stop(proc, signal.SIGTERM)
        log.close()
