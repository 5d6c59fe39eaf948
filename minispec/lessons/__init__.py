"""One module per notebook: the figures, widgets and measurements that notebook calls.

    speculative_sampling  01_speculative_sampling
    dflash                02_dflash
    mtp_boosting          03_mtp_boosting
    nvfp4_qad             04_nvfp4_qad
    mamba_replay          05_mamba_replay
    serving_costs         06_serving_costs
"""
