"""Run folders: checkpoints, model folders, state files, locks, one-shot outputs, provenance and hub ids."""
