"""What keeps a run: its folder, checkpoints and final export, metrics and health, the memory plan, start-up checks."""
