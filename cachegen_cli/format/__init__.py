"""The bytes of a .cgen file (docs/format.md): the header, chunk records, index and trailer
(``container``) and the version-2 Params block (``params``)."""
