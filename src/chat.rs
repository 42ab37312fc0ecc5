//! Chat templates (the Jinja templates that ship with instruct models), rendered with
//! minijinja.

use candle_core::Result;

/// Render `template` for one user message, with the generation prompt appended.
pub fn render_user_prompt(template: &str, user: &str, bos: &str, eos: &str) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.add_template("chat", template)
        .map_err(|e| candle_core::Error::Msg(format!("chat template: {e}")))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| candle_core::Error::Msg(format!("chat template: {e}")))?;
    tmpl.render(minijinja::context! {
        messages => vec![minijinja::context! { role => "user", content => user }],
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
    })
    .map_err(|e| candle_core::Error::Msg(format!("rendering the chat template: {e}")))
}
