"""Framework metrics under ``fleetscope run`` with no script change (one CPU process each, tiny models,
a real server): the Hugging Face ``Trainer``'s (bf16) logged loss, learning rate and grad norm arrive as
``hf/…`` scalars at the steps HF logged them, with HF's own FLOP estimate (``hf/total_flos``) and the
tokens each step consumed (so ``tokens_per_s`` is measured); Lightning's ``self.log`` metrics arrive
as ``lightning/…`` scalars, one value per optimizer step. The scripts know nothing of fleetscope: they
only write what the frameworks themselves recorded, for the comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

FS_RUN = [sys.executable, "-m", "fleetscope.cli", "run"]
STEPS = 5

HF_SCRIPT = '''
import json
import sys

import torch

torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

OUT, K, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
B, T = 4, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 64, (n, T), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=T, bos_token_id=0, eos_token_id=0)
args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=B, gradient_accumulation_steps=K,
                         max_steps=STEPS, learning_rate=1e-3, warmup_steps=2, save_strategy="no", report_to=[],
                         use_cpu=True, bf16=True, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1,
                         seed=0, max_grad_norm=1.0)
trainer = Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(2 * STEPS * K * B))
trainer.train()
with open(OUT + "/log_history.json", "w") as f:
    json.dump(trainer.state.log_history + [{"total_flos": trainer.state.total_flos}], f)
'''

LIGHTNING_SCRIPT = '''
import json
import sys

import torch

torch.set_num_threads(1)
import lightning as L  # noqa: E402

OUT, STEPS = sys.argv[1], int(sys.argv[2])


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        self.seen.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model = Net()
trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
with open(OUT + "/seen.json", "w") as f:
    json.dump(model.seen, f)
'''


def _run(live_server: Any, tmp_path: Path, name: str, script: str, *argv: str) -> tuple[dict[str, Any], Path]:
    (tmp_path / "train.py").write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "FLEETSCOPE_SERVER": live_server.url,
           "FLEETSCOPE_TOKEN": live_server.token, "FLEETSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    env.pop("FLEETSCOPE_RUN_NAME", None)
    res = subprocess.run([*FS_RUN, "--name", name, "--", sys.executable, "train.py", str(out), *argv],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "internal error" not in res.stderr and "capture" not in res.stderr, res.stderr[-5000:]
    deadline = time.monotonic() + 30
    while True:
        live_server.compact()
        runs = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": name}, timeout=10).json()["runs"]
        if runs and runs[0]["status"] == "finished" and runs[0]["steps"] >= STEPS:
            return dict(runs[0]), out
        assert time.monotonic() < deadline, runs
        time.sleep(0.3)


def test_hf_trainer_loss_lr_grad_norm_flops_and_tokens_arrive_without_a_script_change(live_server: Any,
                                                                                      tmp_path: Path) -> None:
    k = 2
    run, out = _run(live_server, tmp_path, "hf-scalars", HF_SCRIPT, str(k), str(STEPS))
    history = json.loads((out / "log_history.json").read_text())
    per_step = [h for h in history if "loss" in h and "step" in h]
    assert len(per_step) == STEPS
    body = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/scalars", timeout=10).json()["scalars"]
    for key in ("loss", "learning_rate", "grad_norm"):
        sc = body[f"hf/{key}"]
        assert sc["step"] == [h["step"] - 1 for h in per_step]  # HF's global_step counts finished steps
        assert sc["value"] == pytest.approx([h[key] for h in per_step], rel=1e-6)
    assert body["hf/learning_rate"]["value"][0] < body["hf/learning_rate"]["value"][1]  # warm-up: the real schedule
    final = next(h for h in history if "total_flos" in h)
    assert body["hf/total_flos"]["value"] == [pytest.approx(final["total_flos"])]
    # tokens: 2 micro-batches × 4 sequences × 16 tokens per step, measured on the rank
    steps = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/steps", timeout=10).json()["steps"]
    assert [s["tokens"] for s in steps[:STEPS]] == [k * 4 * 16] * STEPS
    summary = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/summary", timeout=10).json()
    assert summary["tokens_per_s"] is not None and summary["tokens_per_s"] > 0
    events = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/summary", timeout=10).json()
    with live_server.state.engine.connect() as c:
        from sqlalchemy import text

        # bf16=True: accelerate enters autocast inside the model's forward, after the hook that starts the
        # run; the dtype is read from that wrapper, not from the fp32 parameters
        dtype = c.execute(text("SELECT meta->>'dtype', meta->>'dtype_source' FROM runs WHERE id = :r"),
                          {"r": run["id"]}).one()
        assert tuple(dtype) == ("bf16", "autocast"), dtype
        said = c.execute(text("SELECT data FROM run_events WHERE run_id = :r AND kind = 'framework_capture'"),
                         {"r": run["id"]}).fetchall()
    assert [d for (d,) in said] == [{"framework": "hf_trainer", "tokens": "input_ids.numel per micro-batch"}], events


def test_lightning_self_log_metrics_arrive_once_per_step_without_a_script_change(live_server: Any,
                                                                                 tmp_path: Path) -> None:
    run, out = _run(live_server, tmp_path, "lightning-scalars", LIGHTNING_SCRIPT, str(STEPS))
    seen = json.loads((out / "seen.json").read_text())
    assert len(seen) == STEPS
    body = httpx.get(f"{live_server.url}/api/v1/runs/{run['id']}/scalars", timeout=10).json()["scalars"]
    loss = body["lightning/train_loss"]
    assert loss["step"] == list(range(STEPS))
    assert loss["value"] == pytest.approx(seen, rel=1e-5)
    assert body["lightning/lr"]["value"] == pytest.approx([0.05] * STEPS)
