"""The DynMo paper's published figures, as data to put beside the simulator's.

Quoted from the paper (Figure 3, its caption and text, the abstract, the overhead
discussion and Figure 4) as gathered in the project's issue 15. Layer counts are the
GPT models' decoder layers; the clusters are 720 GPUs (30-way DP x 24-way PP) for
pruning, freezing, sparse attention and early exit, 128 GPUs (8 x 16) for MoE and MoD.
The paper reports, per scenario, the better of its by-parameter and by-time
balancers over the baseline named here.
"""
from __future__ import annotations

__all__ = ["LAYERS", "FIGURE3", "ABSTRACT", "OVERHEAD", "FIGURE4", "BASELINE_TEXT"]

LAYERS = (24, 32, 40, 48)

# scenario -> {layers: speedup}, the paper's baseline, our baseline standing in for it
FIGURE3 = {
    "gradual_pruning": ({24: 2.32, 32: 2.78, 40: 2.84, 48: 2.61}, "static Megatron-LM / DeepSpeed",
                "static_best"),
    "layer_freezing": ({24: 1.36, 32: 1.48, 40: 1.58, 48: 1.69}, "Egeria", "static"),
    "sparse_attention": ({24: 2.71, 32: 3.90, 40: 4.02, 48: 3.73}, "dense attention",
                         "no_dynamism"),
    "early_exit": ({24: 3.07, 32: 2.70, 40: 2.39, 48: 4.83}, "no early exit", "no_dynamism"),
    "mixture_of_depths": ({24: 1.17, 32: 1.17, 40: 1.16, 48: 1.16}, "static", "static_best"),
    # Mixtral 8x7B 1.21x and LLaMA-MoE-3.5B 1.23x: both have 32 decoder layers
    "moe": ({32: (1.21, 1.23)}, "static / Tutel", "static_best"),
}

# the abstract's headline figures, "over static Megatron-LM"; our stand-in baseline
ABSTRACT = {
    "moe": (1.23, "static_best"),
    "gradual_pruning": (3.18, "static_best"),
    "layer_freezing": (2.23, "no_dynamism"),
    "sparse_attention": (4.02, "no_dynamism"),
    "early_exit": (4.52, "no_dynamism"),
    "mixture_of_depths": (1.17, "static_best"),
}
ABSTRACT_REPACK = "reduces GPU usage by up to 50% while maintaining comparable performance"

# overhead (profiling + balancing + migration) as % of training time: (low, high) per
# layer count where the paper gives one per model size, else one range
OVERHEAD = {
    "gradual_pruning": ("<0.1%", 0.0, 0.1),
    "layer_freezing": ("<0.1%", 0.0, 0.1),
    "early_exit": ("<0.1-0.3%", 0.0, 0.3),
    "sparse_attention": ("2 / 7 / 8 / 13% (24 / 32 / 40 / 48 layers)", 2.0, 13.0),
    "mixture_of_depths": ("2 / 5 / 5 / 7% (24 / 32 / 40 / 48 layers)", 2.0, 7.0),
    "moe": ("4-5%", 4.0, 5.0),
}

# Figure 4: repacking during a 10,000-iteration pruning run on 8 GPUs
FIGURE4 = {"scenario": "gradual_pruning", "gpus": 8, "iterations": 10000,
           "gpus_avg": (5.4, 7.2), "repack_share_of_speedup": (0.04, 0.11)}

BASELINE_TEXT = {
    "static": "same dynamism, Megatron's uniform split",
    "static_best": "same dynamism, the faster of Megatron's uniform and DeepSpeed's 'parameters' split",
    "no_dynamism": "the dense model (no dynamism), Megatron's uniform split",
}
