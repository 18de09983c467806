"""Training engines behind one interface (`base.Engine`): mt's own (`mt`, its checkpoints in
`checkpoint`, with the failpoints of their writes in `failpoints`) and DeepSpeed's
(`deepspeed_engine`, `deepspeed_pipe`), and the model stage both build (`build`). Which engine
a run uses, and what each refuses, is the registry `mt_pretrain.config.engines`."""
