"""Training engines behind one interface (`base.Engine`): mt's own (`mt`) and DeepSpeed's
(`deepspeed_engine`, `deepspeed_pipe`), what each refuses (`support`), and the model stage
both build (`build`)."""
