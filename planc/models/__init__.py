"""transformers models from configs, below the runtime (torch and transformers, no process groups).

`build`: configs and model classes, the one meta-device builder (`meta_model`; `planc explain`,
`planc init` and `planc.load` compile against it), and the tiny random models of any MoE family that
the tests, `planc demo` and the family sweep run (`tiny_config`, `build_tiny_model`). `tiny`: the one
tiny-config derivation from a family's own config class. `families`: the MoE families of the
installed transformers and the model each is built as. `synthesis`: a starting plan from what
transformers declares for a family (`planc init`).
"""
