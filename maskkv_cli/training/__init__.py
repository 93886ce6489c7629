"""Training the embedded tiny model (``maskkv train-tiny``) and growing a trained model deeper."""
