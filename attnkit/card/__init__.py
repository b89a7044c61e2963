"""The model card (README.md) that makes every attnkit output folder self-describing.

`convert` and `finetune` call `build.write_model_card(folder)` just before their atomic rename, and
`attnkit push` refreshes it before uploading. Everything in the card comes from files already
in the folder — `attnkit_report.json` (convert), `finetune_report.json` (heal),
`eval_results.json` (`attnkit eval --out`), `config.json` — so the card never states a number
that was not measured.

This package holds what every card shares and knows no method: the method's title comes from the
registry, and what only one method can say (where its output serves, what fine-tuning it takes, what
its cache figure leaves out) comes from that method's own folder, through its registered card hook
(`hooks.py`). Modules: `reports` (reading the folder), `names` (no local paths in a public card),
`metadata` (the YAML front matter), `markdown`, `sections` (the body), `build` (the card and its file).
"""
