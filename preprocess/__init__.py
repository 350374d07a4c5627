"""Media preprocessing (imported as ``omni_rl.preprocess``): decode videos, images and
audio, sample frames, and write the synthetic media that tests and demos use."""
