"""The checkpoint engine: what a training loop calls. It never imports tools/ or convert/."""
