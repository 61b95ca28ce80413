"""Data: corpora, prepared token and pair folders, their samplers, and the training objectives that turn
windows into batches."""
