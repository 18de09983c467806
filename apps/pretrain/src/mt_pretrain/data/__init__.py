"""What a run reads (`inputs`): the datasets (prepared, blended, or the embedded corpus made on
first use), their tokenizer, the checks against the model's vocabulary, and the data loaders
of one data-parallel rank."""
