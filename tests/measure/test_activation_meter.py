"""What autograd saves in a forward of nn/'s Llama, measured by measure.memory.ActivationMeter, against predict.memory's
eager accounting of it, to the byte: fp32 and bf16, dense, Qwen3's head norms and MoE
(routing with room for every copy, as predict assumes). The parallel layouts' shares are held in tests/train/."""

import pytest
import torch

from mlsyslab.measure.memory import ActivationMeter
from mlsyslab.nn.llama import Llama, LlamaConfig
from mlsyslab.parallel.pipeline import mean_cross_entropy
from mlsyslab.predict.assumptions import DEFAULT
from mlsyslab.predict.layout import Layout
from mlsyslab.predict.memory import first_stage_activation_bytes
from mlsyslab.predict.pipeline import stage_layers

TINY = {"vocab": 96, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn_hidden": 64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("changes", [{}, {"qk_norm": True, "head_dim": 16},
                                     {"experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 24,
                                      "capacity_factor": 4.0}], ids=["dense", "qk-norm", "moe"])
def test_the_bytes_saved_for_backward_are_predicts(dtype, changes):
    config = LlamaConfig(**{**TINY, **changes})
    model = Llama(config).initialize(generator=torch.Generator().manual_seed(0)).to(dtype)
    batch, seq = 3, 40
    tokens = torch.randint(0, config.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    meter = ActivationMeter()
    with meter.track([*model.parameters(), x, y]):
        loss = mean_cross_entropy(model(x), y)
    loss.backward()
    spec = config.to_spec("tiny", sum(p.numel() for p in model.parameters()), "test")
    layout = Layout.of(micro_batch=batch, global_batch=batch, seq=seq)
    width = torch.finfo(dtype).bits / 8
    predicted = first_stage_activation_bytes(spec, layout, stage_layers(spec, layout), width,
                                             DEFAULT.override({"eager_activations": True}))
    assert meter.saved_bytes == int(predicted.reshape(-1)[0])
    korthikanti = first_stage_activation_bytes(spec, layout, stage_layers(spec, layout), width)  # Megatron's count
    assert korthikanti < predicted
