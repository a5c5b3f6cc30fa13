"""What the layers above rely on from outside the model: files written atomically, the hub, the process group."""
