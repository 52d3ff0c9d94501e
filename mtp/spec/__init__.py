"""What the speculative stages share, as leaves: `draft/`, `verify/` and `decode/` import these modules, these import
none of them (so imports between the three folders point one way: decode -> draft, verify -> spec).

- `options.py`: option names, limits and `OptionError`, `SamplingParams` (torch-free, read by the front ends' schemas);
- `tree_shape.py`: static draft-tree shapes and their device tables (`TreeShape`, `TreeTensors`);
- `draws.py`: counter-based random draws (`RowDraws`), the filtered target distribution and inverse-CDF sampling
  (drafting samples with the sampling verifier's law).
"""
