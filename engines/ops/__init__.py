"""What the engines share below the algorithms: cache layouts (`layout`), ragged-batch tensor operations
(`ragged`), recurrent-state snapshots and rollback (`recurrent`), and the one call that hands a cache to a
transformers model (`hf_call`)."""
