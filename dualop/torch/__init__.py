"""The PyTorch face of dualop: ``dualop.torch.layers`` holds nn.Modules that own their weights
and call the ops, so config and dispatch apply unchanged."""
