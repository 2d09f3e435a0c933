"""The one pipeline behind `specaudit audit`: the settings (`settings`), the loop over runs (`runner`), the
served oracle (`served`) and the sampled judge against the weights (`sampled`). docs/design.md draws it."""
