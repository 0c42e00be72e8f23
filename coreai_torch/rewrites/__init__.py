"""``nn.Module -> nn.Module`` rewrites applied before export, so that models torch.export
cannot export with dynamic shapes convert: mixture-of-experts blocks
(:func:`~coreai_torch.rewrites.moe.rewrite_moe`) and recurrent layers
(:func:`~coreai_torch.rewrites.recurrent.rewrite_recurrent`).
"""
