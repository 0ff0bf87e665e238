"""Models coming and going: the offline default target and prompts (`assets`, `default_target`), loading targets
and drafters by name or path (`loading`), model cards and `custom_generate/` (`card`), saving, pushing and the
DSpark conversion (`sharing`), and the remote-code `generate` recipe (`custom_generate`).

Imports: everything below it (`core`, `sources`, `drafter`, `decoding`, `calibration`).
"""
