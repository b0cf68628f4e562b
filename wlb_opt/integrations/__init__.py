"""Adapters to other libraries' models and loops. `wlb_opt.integrations.hf`: Hugging Face
transformers (extra ``hf``); imported on demand, so ``import wlb_opt`` never needs them."""
