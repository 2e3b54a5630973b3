"""TorchRec's ``torchrec.metrics`` on recship: RecMetricModule and the metrics it computes (NE, AUC, calibration,
CTR, MSE, ...), with TorchRec's names, constructors and numbers. Each of TorchRec's submodules is one here
(``torchrec.metrics.ne`` -> ``recship.metrics.ne``)."""
