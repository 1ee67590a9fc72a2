"""Moving TransformerLayers between live stages with all their training state (parameters,
gradients, optimizer state, extra state), and repacking a pipeline onto fewer ranks."""
