"""One set of default assumptions predicts every published training run within 15%.

Rows: published_training_runs.yaml beside this file, a copy of the project's anchor
../shared/anchors/published_training_runs.yaml (Megatron-LM 2021 Table 1; Korthikanti et al. 2022
Tables 3 and 5), kept in the repository so that any clone runs this test. No per-row constant is fitted: every row uses `Assumptions()` with one change
that is a fact of all these runs, not a fit: they predate FlashAttention (May 2022), so attention
scores went through HBM (`flash_attention=False`).
"""

from pathlib import Path

import pytest
import yaml

from mlsyslab.predict.architecture import parameters
from mlsyslab.predict.assumptions import Assumptions
from mlsyslab.predict.hardware import Hardware
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.training import predict_training
from mlsyslab.specs import catalog
from mlsyslab.specs.schema import Model

ANCHORS = Path(__file__).with_name("published_training_runs.yaml")
TOLERANCE = 0.15
RUNS_BEFORE_FLASH_ATTENTION = Assumptions(flash_attention=False)


def _rows():
    runs = yaml.safe_load(ANCHORS.read_text())
    for key in ("megatron_2021_table1", "korthikanti_2022"):
        group = runs[key]
        for row in group["rows"]:
            yield pytest.param(group, row, id=f"{key}-{row['params_b']}B")


def _predict(group, row):
    model = Model(name=f"gpt-{row['params_b']}b", source="published run", family="gpt", hidden=row["hidden"],
                  layers=row["layers"], heads=row["heads"], ffn_hidden=4 * row["hidden"], gated_mlp=False,
                  vocab=group["vocab"], tied_embeddings=True, max_seq=group["seq_len"], norm="layernorm",
                  linear_bias=True, learned_positions=group["seq_len"], published_params=row["params_b"] * 1e9)
    tp = row.get("tp", group.get("tp"))
    interleave = row.get("interleave", 1)
    layout = Layout.of(dp=row["gpus"] // (tp * row["pp"]), tp=tp, pp=row["pp"], micro_batch=row.get("micro_batch", 1),
                       global_batch=row["global_batch"], seq=group["seq_len"], recompute=group["recompute"],
                       schedule="interleaved" if interleave > 1 else "1f1b", interleave=interleave,
                       sequence_parallel=group.get("sequence_parallel", False))
    hardware = Hardware.of(*catalog.hardware(group["hardware"]), dtype="bf16")
    return model, predict_training(model, hardware, layout, assumptions=RUNS_BEFORE_FLASH_ATTENTION)


@pytest.mark.parametrize("group, row", list(_rows()))
def test_published_run_within_15_percent(group, row):
    model, prediction = _predict(group, row)
    assert parameters(model).total() == pytest.approx(row["params_b"] * 1e9, rel=0.05)
    assert prediction.feasible.item(), prediction.reason(0)
    peak = Hardware.of(*catalog.hardware(group["hardware"])).peak_flops
    if "tflops_per_gpu_hw" in row:  # hardware FLOP/s, recomputation included
        assert prediction.hfu.item() * peak / 1e12 == pytest.approx(row["tflops_per_gpu_hw"], rel=TOLERANCE)
    if "iteration_s" in row:
        assert prediction.step_s.item() == pytest.approx(row["iteration_s"], rel=TOLERANCE)
    for metric in ("mfu", "hfu"):
        if metric in row:
            assert getattr(prediction, metric).item() == pytest.approx(row[metric], rel=TOLERANCE), metric
