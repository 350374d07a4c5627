"""Experiment tracking: the ``logging:`` section of every training recipe, and a real
flow-PPO run logging to JSONL, TensorBoard and an offline wandb run that a resumed run
appends to, with nothing sent over the network."""

from __future__ import annotations

import json
import re
import socket
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.recipe_loader import config_from_dict, load_config
from omni_rl.recipe_table import trainable
from omni_rl.recipes import flow_ppo
from omni_rl.recipes.common import MetricsLog


@pytest.mark.parametrize("recipe", ["grpo", "sft", "flow_ppo"])
def test_every_training_recipe_has_the_logging_section(recipe):
    assert recipe in trainable()
    cfg = load_config(None, ["logging.backends=[jsonl, tensorboard, wandb]"], recipe=recipe)
    assert cfg.logging.backends == ["jsonl", "tensorboard", "wandb"]
    defaults = load_config(None, recipe=recipe).logging
    assert defaults.backends == ["jsonl", "tensorboard"]
    assert (defaults.wandb_project, defaults.wandb_mode, defaults.wandb_dir) == ("omni_rl", "offline", None)


@pytest.mark.parametrize(
    "backends, message",
    [
        (
            "[jsonl, wandbb]",
            "logging.backends: unknown backend 'wandbb' (did you mean 'wandb'?); known: jsonl, tensorboard, wandb",
        ),
        ("[jsonl, tensorboard, tensorboard]", "logging.backends: 'tensorboard' listed more than once"),
        ("[tensorboard, wandb]", "logging.backends: must include 'jsonl'"),
    ],
    ids=["unknown", "duplicate", "without_jsonl"],
)
def test_backends_are_checked(backends, message):
    with pytest.raises(ConfigError, match="^" + re.escape(f"<grpo defaults>: {message}")):
        load_config(None, [f"logging.backends={backends}"], recipe="grpo")


def test_wandb_mode_is_checked():
    with pytest.raises(
        ConfigError, match=re.escape("logging.wandb_mode: must be one of 'offline', 'online', 'disabled'")
    ):
        load_config(None, ["logging.wandb_mode=onlin"], recipe="sft")


def test_wandb_without_the_package_is_a_setup_error_naming_the_extra(tmp_path, monkeypatch):
    """On every rank (so none waits for a rank that stopped), before anything is written."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    cfg = load_config(None, ["logging.backends=[jsonl, wandb]"], recipe="grpo")
    for main in (True, False):
        with pytest.raises(OmniRLError, match=r"the wandb package is not installed: pip install -e '\.\[wandb\]'"):
            MetricsLog(tmp_path, None, enabled=main, cfg=cfg)
    assert list(tmp_path.iterdir()) == []


def test_only_the_enabled_backends_write(tmp_path):
    cfg = load_config(None, ["logging.backends=[jsonl]"], recipe="grpo")
    log = MetricsLog(tmp_path / "main", None, cfg=cfg)
    log.log({"step": 1, "loss": 0.5})
    log.close()
    assert [p.name for p in (tmp_path / "main").iterdir()] == ["metrics.jsonl"]
    other_rank = MetricsLog(tmp_path / "rank1", None, enabled=False, cfg=cfg)
    other_rank.log({"step": 1, "loss": 0.5})
    other_rank.close()
    assert not (tmp_path / "rank1").exists()


# ------------------------------------------------------------- wandb, offline, for real


def wandb_records(path: Path):
    """The records of a ``.wandb`` transaction log, as wandb's own ``Record`` protobufs.

    The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
    then 32 KiB blocks of chunks, each ``crc32 (4) | length (2, LE) | type (1) | data``,
    type 1 a whole record, 2/3/4 its first/middle/last part; a block's tail shorter than
    a chunk header is zero padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def history(run_dir: Path) -> list[dict]:
    """The rows a wandb run folder's transaction log holds, wandb's ``_step`` etc. dropped."""
    (log,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


class _CountingServer(ThreadingHTTPServer):
    """A loopback stand-in for the wandb server that records every request it gets."""

    def __init__(self):
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                server.requests.append(f"{self.command} {self.path}")
                self.send_response(503)
                self.end_headers()

            do_GET = do_POST = do_PUT = _any

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb pointed at a loopback server that must see no request, its own settings and
    caches kept under tmp_path, and this process's sockets limited to loopback and Unix."""
    server = _CountingServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    outbound: list[object] = []
    connect = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not str(address[0]).startswith(("127.", "::1")):
            outbound.append(address)
            raise OSError(f"test: no network ({address})")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield server, outbound
    server.shutdown()
    server.server_close()


def _process_exit():
    """What wandb's atexit hook does when a training process ends: a finished run's
    transaction log may reach the disk only when wandb's service shuts down."""
    import wandb

    wandb.teardown()


def _flow_config(out: Path, steps: int, backends: list[str]):
    return config_from_dict(
        {
            "recipe": "flow_ppo",
            "run": {"name": "tracked", "output_dir": str(out), "seed": 0, "device": "cpu"},
            "logging": {"backends": backends},
            "env": {"task": "PointMass-v0", "num_envs": 8, "max_episode_steps": 8, "ignore_terminations": False},
            "policy": {"horizon": 2, "executed": 2, "denoise_steps": 2, "width": 16},
            "ppo": {"epochs": 1, "minibatches": 2},
            "trainer": {"steps": steps, "save_every": 1, "eval_every": 0, "eval_episodes": 8},
        },
        "test",
    )


def test_tensorboard_holds_every_scalar_of_every_row_and_a_resume_hides_the_redone_steps(tmp_path):
    """Each row's scalars go to TensorBoard as one event; a run resumed from step 2
    hides the first session's steps after it (``purge_step``) and logs them again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [
        {"step": s, "loss/policy": 0.1 * s - 0.25, "reward/mean": s / 3, "optim/lr": 1e-5, "text": "x"}
        for s in range(5)
    ]
    first = MetricsLog(tmp_path, None)
    for row in rows[:4]:
        first.log({**row, "reward/mean": -1.0} if row["step"] > 2 else row)  # steps 3 on are redone
    first.close()
    resumed = MetricsLog(tmp_path, 2)
    for row in rows[3:]:
        resumed.log(row)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss/policy", "optim/lr", "reward/mean"]
    for tag in events.Tags()["scalars"]:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert logged == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows], tag


def test_a_run_logs_to_every_backend_and_a_resumed_run_appends_to_its_wandb_run(tmp_path, offline_wandb):
    server, outbound = offline_wandb
    out = tmp_path / "run"
    backends = ["jsonl", "tensorboard", "wandb"]
    flow_ppo.train(_flow_config(out, 2, backends))
    _process_exit()
    # a later session: two more iterations from the step-2 checkpoint
    flow_ppo.train(_flow_config(out, 4, backends), resume="auto")
    _process_exit()

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, sorted(p.name for p in (out / "wandb").iterdir())  # one folder per session, one id
    first, resumed = (history(run) for run in runs)
    assert first + resumed == [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in rows], (
        "the wandb history is the JSONL rows"
    )

    # the run's name and resolved config went in with it
    records = list(wandb_records(next(runs[0].glob("run-*.wandb"))))
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_record.run_id, run_record.display_name, run_record.project) == (run_id, "tracked", "omni_rl")
    config = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in run_record.config.update}
    assert config["recipe"] == "flow_ppo"
    assert config["logging"]["backends"] == backends
    assert config["run"]["output_dir"] == str(out)

    assert server.requests == [], "offline wandb contacted its server"
    assert outbound == [], "something tried the network"


def test_a_fresh_run_in_the_same_directory_starts_a_new_wandb_run(tmp_path, offline_wandb):
    cfg = load_config(None, ["logging.backends=[jsonl, wandb]", f"run.output_dir={tmp_path}"], recipe="grpo")
    ids = []
    for _ in range(2):
        log = MetricsLog(tmp_path, None, cfg=cfg)
        log.log({"step": 1, "loss": 0.5})
        log.close()
        ids.append((tmp_path / "wandb_run_id").read_text().strip())
    _process_exit()
    assert ids[0] != ids[1]
    assert [history(next((tmp_path / "wandb").glob(f"offline-run-*-{i}"))) for i in ids] == [
        [{"step": 1, "loss": 0.5}]
    ] * 2
