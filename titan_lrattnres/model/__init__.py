"""The model: flavors and the model config (``registry``; the
ModelSpec around it: ``titan_lrattnres.spec``), the decoder whose residual stream is a
read across depth (``model``), the depth router (``depth``) and the FLOP accounting (``flops``)."""
