"""The model: flavors and the model spec (``registry``), the decoder whose residual stream is a
read across depth (``model``), the depth router (``depth``) and the FLOP accounting (``flops``)."""
