"""Integrations with training frameworks that own the training loop (Megatron-LM's
`pretrain()`): the plugin acts inside their loop instead of the launcher's."""
