"""Other tools' configurations brought over as stack files: llama-swap's ``config.yaml``
and llama.cpp's router presets (``llama-server --models-preset``). Pure translations (text
in, a stack and a typed report out); ``slotctl import`` reads the files and prints."""
