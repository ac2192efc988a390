//! Tests of the prompt side on real chat templates copied from the models'
//! `tokenizer_config.json`.

mod templates;
