"""Training data: rows and cached media as samples and model inputs."""
