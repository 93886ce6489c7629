"""Model families (LLaDA), their configs, and loading/saving in the upstream checkpoint layout."""
