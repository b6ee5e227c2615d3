pub async fn notify(
    ::idem_runtime::signature::Input {
        value: Json(body),
        request: __idem_request,
        ..
    }: ::idem_runtime::signature::Input<
        Json<Value>,
        Sqlite,
        ::idem_runtime::signature::KeyAt<15932227148644786370u64>,
    >,
) -> ::idem_runtime::__private::Response {
    static __IDEM_POLICY: ::idem_runtime::__private::HandlerPolicy = ::idem_runtime::__private::HandlerPolicy::__new(
            "notify",
            ::core::module_path!(),
            ::idem_runtime::__private::KeyScope::Global,
            ::idem_runtime::__private::Mode::External,
            86400u64,
            false,
            30u64,
            ::core::option::Option::None,
            ::core::option::Option::None,
            ::idem_runtime::__private::BodyFields::All,
        )
        .__key(::idem_runtime::KeySource::BodyField("/request_id"), true);
    ::idem_runtime::__private::inventory::submit! {
        ::idem_runtime::__private::Registered(& __IDEM_POLICY)
    }
    ::idem_runtime::__private::inventory::submit! {
        ::idem_runtime::__private::KeySpec { id : 15932227148644786370u64, source :
        ::idem_runtime::KeySource::BodyField("/request_id"), optional : true }
    }
    let __idem_span = __idem_request.span();
    ::idem_runtime::__private::Instrument::instrument(
            async move {
                let __idem_scope = ::idem_runtime::__private::StoredScope::Global;
                let __idem_options = __IDEM_POLICY.__options();
                #[allow(unused_mut)]
                let mut __idem_claim = match ::idem_runtime::__private::ExternalClaim::<
                    Sqlite,
                >::acquire(__idem_request, __idem_scope, __idem_options)
                    .await
                {
                    ::core::result::Result::Ok(__idem_claim) => __idem_claim,
                    ::core::result::Result::Err(__idem_answer) => return __idem_answer,
                };
                fn __idem_into_response(
                    __idem_output: StatusCode,
                ) -> ::idem_runtime::__private::Response {
                    ::idem_runtime::__private::IntoResponse::into_response(__idem_output)
                }
                let __idem_limit = __idem_claim.limit();
                let __idem_output = {
                    ::idem_runtime::__private::run_until(
                            __idem_limit,
                            ::idem_runtime::__private::typed_body::<
                                StatusCode,
                                _,
                            >(async move { send(body).await }),
                        )
                        .await
                };
                let __idem_response = match __idem_output {
                    ::core::option::Option::Some(__idem_value) => {
                        __idem_into_response(__idem_value)
                    }
                    ::core::option::Option::None => {
                        return __idem_claim.stopped(__idem_limit).await;
                    }
                };
                __idem_claim.complete(__idem_response).await
            },
            __idem_span,
        )
        .await
}
