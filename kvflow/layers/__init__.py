"""Building blocks of the models: each has a pure-torch forward and, where it pays, a
fused kernel on the GPU (chosen once, after the model is built)."""
